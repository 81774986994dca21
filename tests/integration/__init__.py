"""Integration tests that run real ``celery worker`` processes against private Redis servers."""
