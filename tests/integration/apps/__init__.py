"""Celery app modules that integration-test fleets run with ``celery -A <module> worker``."""
