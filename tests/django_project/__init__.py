"""A small Django project (a shop taking payments) run by the Django integration tests."""

from tests.django_project.celery import app as celery_app

__all__ = ["celery_app"]
