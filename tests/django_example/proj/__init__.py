"""A user's Django project, laid out as `startproject` and Celery's Django guide lay it out."""

from .celery import app as celery_app

__all__ = ("celery_app",)
