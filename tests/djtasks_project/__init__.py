"""A small Django project whose `@task`s (Django's tasks framework) run on Celery workers."""

from tests.djtasks_project.celery import app as celery_app

__all__ = ["celery_app"]
