"""A jobfence app set up as a user's would be (`jobfence.setup`), serving /metrics.

Variables (besides those of :mod:`tests.integration.apps.common`): ``LOCK_URL`` (Redis),
``KEY_PREFIX``, ``METRICS_PORT`` and ``LEASE_TTL`` (default ``1.5``). ``metrics.work(job,
seconds)`` sleeps `seconds` and returns `job`; `job` is its key. A job whose name ends in
``-busy`` holds a slot of the ``reports`` semaphore (metrics only) while it sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from celery import Celery, Task

from jobfence.config import Settings
from jobfence.tasks import runtime_for, singleton_task
from jobfence.worker.setup import setup
from tests.integration.apps.common import app_on_first_access, make_app

__all__ = ["BUSY_SUFFIX", "SEMAPHORE", "SLOTS", "WORK_TASK", "create_app"]

WORK_TASK = "metrics.work"
BUSY_SUFFIX = "-busy"
SEMAPHORE = "reports"
SLOTS = 2


def work(self: Task, job: str, seconds: float) -> str:
    if job.endswith(BUSY_SUFFIX):  # holds a slot of a semaphore while it works
        with runtime_for(self.app).metrics.holding_slot(SEMAPHORE, limit=SLOTS):
            time.sleep(seconds)
    else:
        time.sleep(seconds)
    return job


def create_app(env: Mapping[str, str], name: str = "metrics_app") -> Celery:
    app = make_app(name, env)
    settings = Settings(
        lock_url=env["LOCK_URL"],
        key_prefix=env["KEY_PREFIX"],
        default_ttl=float(env.get("LEASE_TTL", "1.5")),
        socket_timeout=0.3,
        visibility_timeout=float(env.get("VISIBILITY_TIMEOUT", "60")),
        metrics_port=int(env["METRICS_PORT"]),
        metrics_addr="127.0.0.1",
    )
    setup(app, settings)
    singleton_task(app=app, name=WORK_TASK, key="job", bind=True, shared=False)(work)
    return app


__getattr__ = app_on_first_access(__name__, create_app)
