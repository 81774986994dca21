"""The fault rows' jobfence side: the demo shop's app (payments, stock) plus a poison task.

``celery -A tests.faults.fenced_app worker`` builds the app with ``create_shop_app()`` from
the ``JOBFENCE_*`` variables, exactly as ``demo.app`` does (start-up checks included), and
registers ``fault.poison``: a ``@singleton_task`` whose body counts its delivery in
``LEDGER_URL`` and then kills its own pool process; and :mod:`tests.faults.hold`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import redis
from celery import Celery

from demo.app import create_shop_app
from jobfence.config import UnsafeSettings
from jobfence.config.errors import EX_CONFIG
from jobfence.tasks import SingletonTask, singleton_task
from tests.faults import hold

POISON = "fault.poison"


def deliveries_key(job_id: str) -> str:
    """The Redis counter of the poison job's body starts (on the ledger server)."""
    return f"fenced:deliveries:{job_id}"


def poison(self: SingletonTask, job_id: str) -> None:
    ledger = redis.Redis.from_url(os.environ["LEDGER_URL"], socket_timeout=5.0)
    ledger.incr(deliveries_key(job_id))
    os._exit(1)  # the message that kills its worker: a segfaulting C library, an OOM kill


def build() -> Celery:
    app = create_shop_app()
    singleton_task(app=app, name=POISON, bind=True, shared=False)(poison)
    hold.connect()
    return app


def __getattr__(name: str) -> Any:
    """``app`` for ``celery -A``: built from ``os.environ`` on first access, not on import."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        app = build()
    except UnsafeSettings as exc:
        print(f"jobfence: refusing to start: unsafe settings\n  - {exc}", file=sys.stderr)
        raise SystemExit(EX_CONFIG) from None
    globals()["app"] = app
    return app
