"""A fleet app set up with `jobfence.setup` (so its workers keep custody of their deliveries),
with gated @singleton_tasks and a plain Celery twin: the crash-recovery runs.

Built from the variables of :mod:`tests.integration.apps.common`, ``LEASE_TTL`` (the default
lease TTL, seconds, default 2), ``TASK_TTL`` (the gated tasks' own ``ttl=``, default none),
``QUEUE`` (the default queue; a shared RabbitMQ gets one of its own), ``LIFETIME`` (the gated
tasks' lock lifetime: ``finish``, the default; ``start``, with ``on_conflict="wait"``; or
``unique_for=N``) and ``NAIVE_PUT_BACK`` (set: custody puts a message back under its old tag,
a control). Every task starts,
waits at the job's gate (``Ledger.release``), then has its effect; ``crash.checked`` checks
its lease while it waits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery, Task

from jobfence.config import Settings
from jobfence.tasks import current_job, singleton_task
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
    return _run(self, job_id, timeout, check=lambda: None)


def checked(self: Task, job_id: str, timeout: float = 60.0) -> int | None:
    """Like `gated`, checking the job's lease while it waits: a holder paused past its TTL
    stops with ``LeaseLost`` as soon as it resumes."""
    return _run(self, job_id, timeout, check=current_job().check)


def _run(self: Task, job_id: str, timeout: float, check: Callable[[], None]) -> int | None:
    book = ledger()
    meta = {"task_id": self.request.id, "worker": self.request.hostname}
    book.start(job_id, **meta)
    deadline = time.monotonic() + timeout
    while not book.released(job_id):
        check()
        if time.monotonic() >= deadline:
            book.end(job_id, timed_out=True, **meta)
            return None
        time.sleep(0.02)
    count = book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return count


def put_back_under_the_same_tag() -> None:
    """The control of issue 29's defect 1: custody puts a message back as it did before, with
    kombu's `restore_by_tag`, under the tag its first holder still holds."""
    from jobfence.worker.custody import Custody

    def put_back(self: Custody, tag: str) -> bool:
        self.qos.restore_by_tag(tag, client=self.channel.client)
        return True

    Custody.put_back = put_back  # type: ignore[method-assign]


def lifetime(env: Mapping[str, str]) -> dict[str, Any]:
    """The `singleton_task` options of ``LIFETIME`` (``finish``, ``start``, ``unique_for=N``)."""
    raw = env.get("LIFETIME") or "finish"
    if raw == "finish":
        return {}
    if raw == "start":  # a copy meeting the running one must not be dropped: wait behind it
        return {"lock_until": "start", "on_conflict": "wait"}
    if raw.startswith("unique_for="):
        return {"unique_for": float(raw.removeprefix("unique_for="))}
    raise ValueError(f"LIFETIME must be finish, start or unique_for=<seconds>, got {raw!r}")


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
    if env.get("NAIVE_PUT_BACK"):
        put_back_under_the_same_tag()
    if env.get("QUEUE"):
        app.conf.task_default_queue = env["QUEUE"]
    task_ttl = float(env["TASK_TTL"]) if env.get("TASK_TTL") else None  # None: the default
    options = {"bind": True, "shared": False, "ttl": task_ttl, **lifetime(env)}
    singleton_task(app=app, name="crash.fenced", **options)(gated)
    singleton_task(app=app, name="crash.checked", **options)(checked)
    app.task(name="crash.plain", bind=True, shared=False, acks_late=True,
             reject_on_worker_lost=True)(gated)  # fmt: skip
    return app


__getattr__ = app_on_first_access(__name__, create_app)
