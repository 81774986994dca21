"""Celery configuration shared by every integration-test app, built from environment variables.

Every test app (the plain-Celery control app, the ``@singleton_task`` app) builds its Celery
instance with :func:`make_app`, so the control runs and the singleton runs see exactly the
same broker behaviour. Variables (all strings, as in ``os.environ``):

``BROKER_URL``
    Required. The Redis broker, e.g. ``redis://127.0.0.1:6400/0``.
``LEDGER_URL``
    Redis URL where test tasks record their executions (default: ``BROKER_URL``).
``RESULT_BACKEND``
    Optional result backend; without it results are ignored.
``VISIBILITY_TIMEOUT``
    Seconds an unacked message may stay with a consumer before any worker puts it back on
    the queue (default ``2``).
``UNACKED_RESTORE_INTERVAL``
    Seconds between the workers' sweeps for expired unacked messages (default ``0.5``).
``UNACKED_MUTEX_EXPIRE``
    TTL of the sweep mutex, so a worker killed mid-sweep blocks sweeps only this long
    (default ``5``).
``BROKER_TRANSPORT_OPTIONS``
    Optional JSON object merged over the transport options above (e.g. ``socket_timeout``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery

__all__ = [
    "DEFAULT_UNACKED_MUTEX_EXPIRE",
    "DEFAULT_UNACKED_RESTORE_INTERVAL",
    "DEFAULT_VISIBILITY_TIMEOUT",
    "app_env",
    "app_on_first_access",
    "celery_config",
    "make_app",
    "transport_options",
]

DEFAULT_VISIBILITY_TIMEOUT = 2.0
DEFAULT_UNACKED_RESTORE_INTERVAL = 0.5
DEFAULT_UNACKED_MUTEX_EXPIRE = 5.0


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {raw!r}")
    return value


def transport_options(env: Mapping[str, str]) -> dict[str, Any]:
    """``broker_transport_options`` that make kombu's Redis transport redeliver within seconds.

    kombu 5.7 (``kombu/transport/redis.py``): every worker's event loop calls
    ``MultiChannelPoller.maybe_restore_messages`` every ``unacked_restore_interval`` seconds
    (``loop.call_repeatedly`` in ``Transport.register_with_event_loop``; default 10), and
    ``QoS.restore_visible`` only scans on every ``unacked_restore_throttle``-th call
    (default 10): by default an expired message waits up to ~100 s after its visibility
    timeout. With throttle 1 the scan runs on every tick, so a message is back on the queue
    at most ``visibility_timeout + unacked_restore_interval`` seconds after it was delivered.
    The scan holds a Redis lock that expires after ``unacked_mutex_expire`` (default 300 s):
    a worker SIGKILLed mid-scan would otherwise stop all redelivery for five minutes.
    """
    options: dict[str, Any] = {
        "visibility_timeout": _float(env, "VISIBILITY_TIMEOUT", DEFAULT_VISIBILITY_TIMEOUT),
        "unacked_restore_interval": _float(
            env, "UNACKED_RESTORE_INTERVAL", DEFAULT_UNACKED_RESTORE_INTERVAL
        ),
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": _float(env, "UNACKED_MUTEX_EXPIRE", DEFAULT_UNACKED_MUTEX_EXPIRE),
    }
    extra = env.get("BROKER_TRANSPORT_OPTIONS")
    if extra:
        parsed = json.loads(extra)
        if not isinstance(parsed, dict):
            raise ValueError("BROKER_TRANSPORT_OPTIONS must be a JSON object")
        options.update(parsed)
    return options


def celery_config(env: Mapping[str, str]) -> dict[str, Any]:
    """The Celery settings of every test app: acks_late, reject on worker lost, JSON only."""
    broker_url = env.get("BROKER_URL")
    if not broker_url:
        raise RuntimeError("BROKER_URL is not set: the test app needs a broker")
    result_backend = env.get("RESULT_BACKEND") or None
    return {
        "broker_url": broker_url,
        "broker_transport_options": transport_options(env),
        "broker_connection_retry_on_startup": True,
        "result_backend": result_backend,
        "task_ignore_result": result_backend is None,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": False,
        "task_send_sent_event": False,
        "enable_utc": True,
        "timezone": "UTC",
    }


def make_app(name: str, env: Mapping[str, str]) -> Celery:
    """A Celery app named ``name`` configured from ``env`` (workers and test-side clients)."""
    app = Celery(name, set_as_current=False)
    app.conf.update(celery_config(env))
    return app


def app_on_first_access(
    module: str, create_app: Callable[[Mapping[str, str]], Celery]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that gives ``app`` for ``celery -A``: built by `create_app`
    from ``os.environ`` on first access, not on import, then kept in the module."""

    def __getattr__(name: str) -> Any:
        if name != "app":
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        app = create_app(os.environ)
        sys.modules[module].app = app
        return app

    return __getattr__


def app_env(
    broker_url: str,
    *,
    ledger_url: str | None = None,
    visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
    restore_interval: float = DEFAULT_UNACKED_RESTORE_INTERVAL,
    **extra: str,
) -> dict[str, str]:
    """The environment variables understood by :func:`celery_config`, ready for a ``Fleet``."""
    env = {
        "BROKER_URL": broker_url,
        "LEDGER_URL": ledger_url or broker_url,
        "VISIBILITY_TIMEOUT": repr(float(visibility_timeout)),
        "UNACKED_RESTORE_INTERVAL": repr(float(restore_interval)),
    }
    env.update(extra)
    return env
