"""Django settings of the test shop, built from environment variables the test sets.

``SHOP_DB_NAME`` (PostgreSQL on 127.0.0.1:5432, user postgres), ``SHOP_BROKER_URL``,
``SHOP_LOCK_URL`` (a private redis-server), ``VISIBILITY_TIMEOUT`` (seconds, short in tests).
jobfence reads its JOBFENCE_* names from here: none is in the worker's environment.
"""

from __future__ import annotations

import os

from tests.integration.apps.common import transport_options

SECRET_KEY = "django-insecure-test-shop"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["jobfence.tasks.django", "tests.django_project.shop"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("SHOP_DB_NAME", "shop"),
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "5432",
    }
}

# Celery, the Django way: app.config_from_object("django.conf:settings", namespace="CELERY").
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_TRANSPORT_OPTIONS = transport_options(os.environ)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESULT_BACKEND = os.environ.get("SHOP_RESULT_BACKEND") or None
CELERY_TASK_IGNORE_RESULT = True  # only shop.fenced_write keeps its result
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# jobfence, from Django settings (the environment would win over these).
JOBFENCE_LOCK_URL = os.environ.get("SHOP_LOCK_URL", "redis://127.0.0.1:6379/1")
JOBFENCE_DEFAULT_TTL = 4.0
JOBFENCE_SOCKET_TIMEOUT = 0.5
JOBFENCE_KEY_SECRET = "test-shop-secret-0123456789abcdef"
JOBFENCE_VISIBILITY_TIMEOUT = CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"]
