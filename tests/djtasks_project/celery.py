"""The billing project's Celery app: Django's way, plus the carrier of Django tasks."""

from __future__ import annotations

import os

from celery import Celery

from jobfence.config import Settings
from jobfence.tasks import install

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.djtasks_project.settings")

# The workers run Django tasks through jobfence's carrier task (CeleryBackend).
app = Celery("billing", include=["jobfence.tasks.django_tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# Not jobfence.setup(app): the test's 1 s visibility timeout forces redeliveries, which
# setup's start-up checks rightly refuse (a lease TTL must be shorter than it).
install(app, Settings())
