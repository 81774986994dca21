"""The project's settings.py (startproject's, trimmed), with Celery's and jobfence's."""

import os

SECRET_KEY = "django-insecure-example"
DEBUG = True
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "billing"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("PROJ_DB_NAME", "proj"),
        "USER": "postgres",
        "HOST": "127.0.0.1",
    }
}
CELERY_BROKER_URL = os.environ.get("PROJ_BROKER_URL", "redis://127.0.0.1:6379/1")

INSTALLED_APPS += ["jobfence.tasks.django"]  # app label "jobfence"; then manage.py migrate
JOBFENCE_LOCK_URL = os.environ.get("PROJ_LOCK_URL", "redis://127.0.0.1:6379/2")
JOBFENCE_DEFAULT_TTL = 30  # any JOBFENCE_* setting, by its name
# JOBFENCE_KEY_SECRET stays in the environment (it wins over settings.py), out of the code.
