"""Settings of the billing project, from variables the test sets.

``BILLING_DB_NAME`` (PostgreSQL on 127.0.0.1:5432, user postgres), ``BILLING_BROKER_URL``,
``BILLING_LOCK_URL`` (a private redis-server), ``VISIBILITY_TIMEOUT`` (short in tests).
"""

from __future__ import annotations

import os

from tests.integration.apps.common import transport_options

SECRET_KEY = "django-insecure-test-billing"
USE_TZ = True
INSTALLED_APPS = ["tests.djtasks_project.billing"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("BILLING_DB_NAME", "billing"),
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "5432",
    }
}

# Django's tasks framework: "default" gates every @task through jobfence on Celery workers;
# "plain" is the same Celery backend without the gate (the control).
CELERY_BACKEND = "jobfence.tasks.django_tasks.CeleryBackend"
TASKS = {
    "default": {
        "BACKEND": "jobfence.tasks.django_tasks.FencedBackend",
        "OPTIONS": {
            "backend": CELERY_BACKEND,
            "options": {"app": "tests.djtasks_project.celery.app"},
        },
    },
    "plain": {
        "BACKEND": CELERY_BACKEND,
        "OPTIONS": {"app": "tests.djtasks_project.celery.app"},
    },
}

CELERY_BROKER_URL = os.environ.get("BILLING_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_TRANSPORT_OPTIONS = transport_options(os.environ)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

JOBFENCE_LOCK_URL = os.environ.get("BILLING_LOCK_URL", "redis://127.0.0.1:6379/1")
JOBFENCE_DEFAULT_TTL = 4.0
JOBFENCE_SOCKET_TIMEOUT = 0.5
JOBFENCE_KEY_SECRET = "test-billing-secret-0123456789abcdef"
JOBFENCE_VISIBILITY_TIMEOUT = CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"]
