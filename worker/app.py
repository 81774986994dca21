"""The composition root: `create_app(settings)` builds the Celery app and its jobfence runtime."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from celery import Celery
from celery.schedules import crontab

from jobfence.config import Settings, UnsafeSettings, load_settings
from jobfence.config.schemes import backend_schemes
from jobfence.config.settings import ENV_PREFIX
from jobfence.worker.setup import BEAT_SCHEDULER, JSON_ONLY, safe_config, setup, transport_options

log = logging.getLogger(__name__)

__all__ = [
    "BEAT_SCHEDULER",
    "JSON_ONLY",
    "broker_urls",
    "celery_config",
    "create_app",
    "parse_crontab",
    "redis_db_url",
    "transport_options",
]


def redis_db_url(url: str, db: int) -> str:
    """The same redis:// or rediss:// server as `url`, database `db`."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "db"]
    return urlunsplit(parts._replace(path=f"/{db}", query=urlencode(query)))


def broker_urls(settings: Settings) -> tuple[str, str]:
    """(broker, result backend): the settings', else databases 1 and 2 of the lock server."""
    scheme = urlsplit(settings.lock_url).scheme
    redis = backend_schemes("redis")
    if scheme == backend_schemes("memory").plain:
        defaults = ("memory://", "cache+memory://")  # Celery's in-process broker and results
    elif scheme in (redis.plain, redis.tls):
        defaults = (redis_db_url(settings.lock_url, 1), redis_db_url(settings.lock_url, 2))
    elif settings.broker_url and settings.result_backend:
        defaults = (settings.broker_url, settings.result_backend)
    else:  # kombu and Celery spell unix sockets their own ways: no safe guess
        raise UnsafeSettings(
            f"{ENV_PREFIX}BROKER_URL",
            f"cannot derive the broker and result backend from a {scheme}:// lock URL",
            f"set {ENV_PREFIX}BROKER_URL and {ENV_PREFIX}RESULT_BACKEND",
        )
    return settings.broker_url or defaults[0], settings.result_backend or defaults[1]


def parse_crontab(text: str) -> crontab:
    """`"30 2 * * *"` (minute hour day-of-month month day-of-week) as a Celery crontab."""
    fields = text.split()
    if len(fields) != 5:
        raise ValueError(
            f"crontab {text!r} needs 5 fields: minute hour day-of-month month day-of-week"
        )
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    return crontab(
        minute=minute,
        hour=hour,
        day_of_month=day_of_month,
        month_of_year=month_of_year,
        day_of_week=day_of_week,
    )


def available_modules(names: Sequence[str]) -> list[str]:
    """The task modules that exist (imported by the worker later, never here)."""
    found = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            log.warning("task module %s not found; its tasks are not registered", name)
        else:
            found.append(name)
    return found


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery settings `create_app` gives: `setup`'s safe ones, the broker and backend, UTC."""
    broker, backend = broker_urls(settings)
    return {
        "broker_url": broker,
        "result_backend": backend,
        **safe_config(settings),
        "enable_utc": True,
        "timezone": "UTC",
    }


def create_app(
    settings: Settings | None = None,
    *,
    main: str = "jobfence",
    include: Sequence[str] = (),
    beat_schedule: Mapping[str, Any] | None = None,
    **conf: Any,
) -> Celery:
    """Build a Celery app from `settings` (default: JOBFENCE_* from the environment).

    Nothing here talks to a server: the start-up checks run when a worker or beat starts
    (`celeryd_init` / `beat_init`). The app holds only what its caller names: `include`, the
    task modules its workers import (those not found are left out, with a warning), and
    `beat_schedule`, its periodic jobs (none by default); `conf` overrides Celery settings.
    """
    settings = settings if settings is not None else load_settings()
    app = Celery(main, include=available_modules(include))
    app.conf.update(celery_config(settings))
    app.conf.beat_schedule = dict(beat_schedule) if beat_schedule is not None else {}
    if conf:
        app.conf.update(conf)
    setup(app, settings)  # the same wiring a user's own app gets
    return app
