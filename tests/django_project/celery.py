"""The shop's Celery app, set up the way Celery's Django guide does it."""

from __future__ import annotations

import os

from celery import Celery

from jobfence.config import Settings
from jobfence.tasks import install

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# jobfence reads JOBFENCE_* from the Django settings loaded above. Not jobfence.setup(app):
# the tests give the broker a 1 s visibility timeout to force redeliveries, which setup's
# start-up checks rightly refuse (a lease TTL must be shorter than it).
install(app, Settings())
