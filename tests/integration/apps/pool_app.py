"""The singleton test app wired like production (worker.signals), plus a task that holds its lease.

Built from the same variables as :mod:`tests.integration.apps.singleton_app` (``LEASE_TTL``
and the rest), plus the signal wiring of ``worker.app.create_app``: the lease keeper starts
in each prefork child at ``worker_process_init`` and the runtime closes at process and worker
shutdown. Two more things are recorded in the Ledger:

* every ``worker_process_init`` (pool child start), with the number of keeper threads alive
  in that child right after the wiring ran (:func:`process_inits`);
* in each start record of ``singleton.pool_hold``, the pid, thread and number of keeper
  threads of the process that runs the body.

``singleton.pool_hold(job_id, timeout)`` starts, waits at the job's gate (``Ledger.release``),
checks that its lease is still held, has its effect and ends; it fails if the gate stays shut
for ``timeout`` seconds. As a ``singleton.*`` task its outcomes are recorded too.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery, Task, signals

from jobfence.tasks import current_job, runtime_for, singleton_task
from jobfence.worker import signals as wiring
from tests.integration.apps import singleton_app
from tests.integration.apps.common import app_on_first_access
from tests.integration.ledger import Ledger

__all__ = ["HOLD_TASK", "create_app", "keeper_threads", "process_inits"]

HOLD_TASK = "singleton.pool_hold"
_INITS = "_process_init"


def keeper_threads(name: str) -> int:
    """Live threads of this process named ``name`` (the lease keeper's thread name)."""
    return sum(1 for t in threading.enumerate() if t.name == name and t.is_alive())


def process_inits(book: Ledger) -> list[dict[str, Any]]:
    """Every ``worker_process_init`` recorded so far: pid and keeper threads alive."""
    return [json.loads(r) for r in book.client.lrange(book.key(_INITS, "records"), 0, -1)]


def hold(self: Task, job_id: str, timeout: float = 30.0) -> dict[str, Any]:
    """Start, wait at the gate, check the lease is still ours, have the effect, end."""
    book = singleton_app.ledger()
    job = current_job()
    keeper = runtime_for(self.app).keeper
    meta = {
        "task_id": self.request.id,
        "worker": self.request.hostname,
        "key": job.key,
        "fence": job.fence,
        "thread": threading.current_thread().name,
        "keepers": keeper_threads(keeper.name),
    }
    book.start(job_id, **meta)
    deadline = time.monotonic() + timeout
    while not book.released(job_id):
        if time.monotonic() >= deadline:
            book.end(job_id, timed_out=True, **meta)
            raise TimeoutError(f"gate of {job_id} still shut after {timeout:g}s")
        time.sleep(0.02)
    job.check()  # LeaseLost if it lapsed: the executor then stores no DONE
    count = book.effect(job_id, **meta)
    book.end(job_id, timed_out=False, **meta)
    return {"job": job_id, "fence": job.fence, "pid": os.getpid(), "effects": count}


def create_app(env: Mapping[str, str], name: str = "pool_app") -> Celery:
    """``singleton_app.create_app`` plus the production signal wiring and ``pool_hold``."""
    app = singleton_app.create_app(env, name)
    runtime = runtime_for(app)
    wiring.connect(app, runtime)

    def on_process_init(**_: Any) -> None:
        # Connected after the wiring, so it runs after the wiring started the keeper.
        book = singleton_app.ledger()
        record = {"pid": os.getpid(), "keepers": keeper_threads(runtime.keeper.name)}
        book.client.rpush(book.key(_INITS, "records"), json.dumps(record))

    wiring.keep_alive(app, on_process_init)
    signals.worker_process_init.connect(on_process_init, weak=True)
    singleton_task(app=app, name=HOLD_TASK, bind=True, shared=False)(hold)
    return app


__getattr__ = app_on_first_access(__name__, create_app)
