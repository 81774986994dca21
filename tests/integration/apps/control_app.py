"""Plain Celery tasks (no jobfence) that record every execution: the duplicate controls."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task

from tests.integration.apps.common import make_app
from tests.integration.ledger import Ledger

app = make_app("control_app", os.environ)

_ledger: Ledger | None = None
_ledger_pid: int | None = None


def ledger() -> Ledger:
    """This process's ledger client (made after fork, so pool children never share sockets)."""
    global _ledger, _ledger_pid
    if _ledger is None or _ledger_pid != os.getpid():
        url = os.environ.get("LEDGER_URL") or os.environ["BROKER_URL"]
        _ledger, _ledger_pid = Ledger.from_url(url), os.getpid()
    return _ledger


def _delivery(task: Task) -> dict[str, Any]:
    request = task.request
    info = request.delivery_info or {}
    return {
        "task_id": request.id,
        "worker": request.hostname,
        "redelivered": bool(info.get("redelivered")),
        "retries": request.retries,
    }


@app.task(name="control.record", bind=True, acks_late=True, reject_on_worker_lost=True)
def record(self: Task, job_id: str) -> int:
    """Start, have the effect, end: the smallest job there is."""
    book = ledger()
    meta = _delivery(self)
    book.start(job_id, **meta)
    count = book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return count


@app.task(name="control.slow", bind=True, acks_late=True, reject_on_worker_lost=True)
def slow(self: Task, job_id: str, seconds: float) -> int:
    """Start, sleep ``seconds``, then have the effect."""
    book = ledger()
    meta = _delivery(self)
    book.start(job_id, **meta)
    time.sleep(seconds)
    count = book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return count


@app.task(name="control.gated", bind=True, acks_late=True, reject_on_worker_lost=True)
def gated(self: Task, job_id: str, timeout: float = 30.0, effect_first: bool = False) -> int | None:
    """Start, then wait until the test calls ``Ledger.release(job_id)`` (or ``timeout``).

    The effect happens after the gate opens, or, with ``effect_first``, before waiting (the
    shape of "the charge went through, then the worker died before the ack"). A body that
    times out at the gate has no after-gate effect and records ``timed_out`` in its end.
    """
    book = ledger()
    meta = _delivery(self)
    book.start(job_id, **meta)
    count = book.effect(job_id, phase="before", **meta) if effect_first else None
    deadline = time.monotonic() + timeout
    while not book.released(job_id):
        if time.monotonic() >= deadline:
            book.end(job_id, timed_out=True, **meta)
            return count
        time.sleep(0.02)
    if not effect_first:
        count = book.effect(job_id, phase="after", **meta)
    book.end(job_id, timed_out=False, **meta)
    return count


class NaiveLockTask(Task):  # type: ignore[misc]
    """The blog posts' lock: SET NX with a TTL when the body starts, DEL in ``after_return``."""

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        book = ledger()
        book.client.delete(book.key(str(args[0]), "naive_lock"))


@app.task(
    name="control.naive_retry",
    bind=True,
    base=NaiveLockTask,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=2,
)
def naive_retry(self: Task, job_id: str) -> int | None:
    """Take the naive lock, ``self.retry()`` once, then have the effect.

    Celery skips ``after_return`` for RETRY, so the retry finds the lock still held by its
    own first attempt: it records an ``outcome`` with ``blocked`` and gives up.
    """
    book = ledger()
    meta = _delivery(self)
    if not book.client.set(book.key(job_id, "naive_lock"), str(self.request.id), nx=True, ex=30):
        book.outcome(job_id, blocked=True, **meta)
        return None
    book.start(job_id, **meta)
    if self.request.retries == 0:
        book.end(job_id, **meta)
        raise self.retry(countdown=0)
    count = book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return count
