"""A fleet app set up with `jobfence.setup` (so its workers keep custody of their deliveries),
with one gated @singleton_task and its plain Celery twin: the crash-recovery runs.

Built from the variables of :mod:`tests.integration.apps.common`, ``LEASE_TTL`` (seconds,
default 2) and ``QUEUE`` (the default queue; a shared RabbitMQ gets one of its own). Both
tasks start, wait at the job's gate (``Ledger.release``), then have their effect.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from celery import Celery, Task

from jobfence.config import Settings
from jobfence.tasks import singleton_task
from jobfence.worker.setup import setup
from tests.integration.apps.common import app_on_first_access, make_app, transport_options
from tests.integration.ledger import Ledger

_ledger: Ledger | None = None
_ledger_pid: int | None = None


def ledger() -> Ledger:
    """This process's ledger client (made after fork, so pool children never share sockets)."""
    global _ledger, _ledger_pid
    if _ledger is None or _ledger_pid != os.getpid():
        url = os.environ.get("LEDGER_URL") or os.environ["BROKER_URL"]
        _ledger, _ledger_pid = Ledger.from_url(url), os.getpid()
    return _ledger


def gated(self: Task, job_id: str, timeout: float = 60.0) -> int | None:
    """Start, wait until the test opens the job's gate (or ``timeout``), then the effect."""
    book = ledger()
    meta = {"task_id": self.request.id, "worker": self.request.hostname}
    book.start(job_id, **meta)
    deadline = time.monotonic() + timeout
    while not book.released(job_id):
        if time.monotonic() >= deadline:
            book.end(job_id, timed_out=True, **meta)
            return None
        time.sleep(0.02)
    count = book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return count


def create_app(env: Mapping[str, str]) -> Celery:
    """The app: `setup` with short leases, the fenced task and its plain twin."""
    app = make_app("crash_app", env)
    setup(
        app,
        Settings(
            lock_url=env.get("LOCK_URL") or env["BROKER_URL"],
            default_ttl=float(env.get("LEASE_TTL") or 2.0),
            socket_timeout=0.5,
            visibility_timeout=float(transport_options(env)["visibility_timeout"]),
        ),
    )
    if env.get("QUEUE"):
        app.conf.task_default_queue = env["QUEUE"]
    singleton_task(app=app, name="crash.fenced", bind=True, shared=False)(gated)
    app.task(name="crash.plain", bind=True, shared=False, acks_late=True,
             reject_on_worker_lost=True)(gated)  # fmt: skip
    return app


__getattr__ = app_on_first_access(__name__, create_app)
