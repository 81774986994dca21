"""Celery's Django set-up, plus one jobfence line: the one place `jobfence.setup` goes."""

import os

from celery import Celery

import jobfence

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
jobfence.setup(app)  # after config_from_object; reads JOBFENCE_* from settings.py
app.autodiscover_tasks()
