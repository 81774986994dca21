"""Fault helpers: a job published twice, delivered twice, its lease lost or fence outdated
mid-body, its lock server down; each delivery committed as a worker's would be."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from uuid import uuid4

from jobfence.tasks.errors import JobNotSettled
from jobfence.tasks.testing.lock_server import FAULT_POINTS, FaultPoint, LockServerForTests
from jobfence.tasks.testing.record import Decision, DecisionRecord, Trigger

_log = logging.getLogger(__name__)


class FaultHelpers(DecisionRecord):
    """The faults a test can stage around its task's deliveries, on the test's lock server
    (each helper delivers the job itself, through `task.apply`)."""

    lock_server: LockServerForTests

    def publish_duplicate(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The job published twice (two messages, two task ids), both delivered; returns
        their results (EagerResult)."""
        return [self._deliver(task, args, kwargs) for _ in range(2)]

    def redeliver(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """One message delivered twice (the same task id), as after a lost ack."""
        task_id = str(uuid4())
        return [self._deliver(task, args, kwargs, task_id) for _ in range(2)]

    def lose_lease_during(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The job runs; as its body starts its lease expires, and a copy takes the key (a
        newer fence) and runs to the end; then the first body goes on. Returns both results,
        the first delivery's last."""
        first = str(uuid4())
        results: list[Any] = []

        def copy_runs(d: Decision) -> bool:
            if d.task_id != first or d.event not in ("started", "plain_started"):
                return False
            if d.key:
                self.lock_server.force_release(d.key)
            results.append(self._deliver(task, args, kwargs))
            return True

        (last,) = self._armed(copy_runs, lambda: self._deliver(task, args, kwargs, first))
        return [*results, last]

    def stale_fence_during(
        self, task: Any, advance: Callable[[int], Any], /, *args: Any, **kwargs: Any
    ) -> Any:
        """The job runs; as its body starts, a newer holder takes the key and calls
        `advance(newer_fence)` (your guard's write, e.g. ``lambda f:
        guard.check_and_advance("payment:7", f)``); the body's guarded write then carries a
        stale fence. A plain task has no fence: `advance(1)`. Returns the result."""
        first = str(uuid4())

        def newer_holder(d: Decision) -> bool:
            if d.task_id != first or d.event not in ("started", "plain_started"):
                return False
            newer = 1
            if d.key:
                self.lock_server.force_release(d.key)
                lease = self.lock_server.try_acquire(d.key, 60.0)
                assert lease is not None, "the key was just freed"
                newer = lease.fence
                lease.release()
            advance(newer)
            return True

        return self._armed(newer_holder, lambda: self._deliver(task, args, kwargs, first))[0]

    def unavailable_at_begin(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The job published twice while the lock server does not answer; once it answers,
        each delivery that did not settle is delivered again. Returns the last results."""
        self.lock_server.fail("begin", times=None)
        try:
            ids = [str(uuid4()) for _ in range(2)]
            results = [self._deliver(task, args, kwargs, i) for i in ids]
        finally:
            self.lock_server.restore()
        return [
            self._deliver(task, args, kwargs, i) if _unsettled(r) else r
            for i, r in zip(ids, results, strict=True)
        ]

    def unavailable_at_commit(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The body runs, and the lock server answers none of the job's commits until its
        lease has run out: the commit's outcome is unknown, and the message is delivered
        again (the body runs again; only its effects' own DONE rows, or a write that is
        idempotent, keep it from taking effect twice). Returns both results."""
        task_id = str(uuid4())
        self.lock_server.fail("commit", times=None)
        try:
            first = self._deliver(task, args, kwargs, task_id)
        finally:
            self.lock_server.restore()
        return [first, self._deliver(task, args, kwargs, task_id)]

    @contextmanager
    def lock_server_down(self, at: FaultPoint | None = None) -> Iterator[None]:
        """Inside: the lock server answers no `at` ("begin", "commit"; None: neither)."""
        for point in FAULT_POINTS if at is None else (at,):
            self.lock_server.fail(point, times=None)  # type: ignore[arg-type]
        try:
            yield
        finally:
            self.lock_server.restore()

    def _armed(self, trigger: Trigger, deliver: Callable[[], Any]) -> list[Any]:
        with self._lock:
            self._triggers.append(trigger)
        try:
            return [deliver()]
        finally:
            with self._lock:
                if trigger in self._triggers:
                    self._triggers.remove(trigger)

    def _deliver(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 task_id: str | None = None) -> Any:  # fmt: skip
        with _as_committed_by_a_worker():
            return task.apply(args=args, kwargs=kwargs, task_id=task_id or str(uuid4()))


@contextmanager
def _as_committed_by_a_worker() -> Iterator[None]:
    """A delivery commits as a worker's would, even inside a test's own transaction.

    A worker runs each delivery in a transaction of its own, committed when the body ends.
    A Django test (``TestCase``, pytest-django's default ``django_db``) runs inside one
    atomic block, rolled back at its end: there the job's effects become a savepoint, its
    DONE record waits for an ``on_commit`` that never comes, and a duplicate delivery runs
    the body and is answered by the DONE row alone. Where every open block on a connection
    is the test case's own, the ``on_commit`` callbacks the delivery registered run when it
    returns (what ``TestCase.captureOnCommitCallbacks(execute=True)`` does), so the next
    copy is answered by the DONE record, as on a fleet. The lock server is the test's own,
    gone with the test's rollback; a block of the test's own (``transaction.atomic()``)
    keeps its callbacks until it commits."""
    db, conf = sys.modules.get("django.db"), sys.modules.get("django.conf")
    if db is None or conf is None or not conf.settings.configured:  # no Django project here
        yield
        return
    marks: list[tuple[Any, int]] = []
    for connection in db.connections.all(initialized_only=True):
        blocks = getattr(connection, "atomic_blocks", [])
        if (
            connection.in_atomic_block
            and blocks
            and all(getattr(block, "_from_testcase", False) for block in blocks)
        ):
            marks.append((connection, len(connection.run_on_commit)))
    yield
    for connection, mark in marks:
        if connection.in_atomic_block and len(connection.run_on_commit) > mark:
            callbacks = connection.run_on_commit[mark:]
            del connection.run_on_commit[mark:]
            for _, callback, robust in callbacks:
                if robust:
                    try:
                        callback()
                    except Exception:  # robust: Django logs it and goes on
                        _log.exception("on_commit callback %r failed", callback)
                else:
                    callback()


def _unsettled(result: Any) -> bool:
    return isinstance(getattr(result, "result", None), JobNotSettled)
