"""The running job as the task body sees it: lease, fence and idempotency key."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from jobfence.locks.errors import LockError
from jobfence.locks.lease import Lease


class OuterCommit:
    """A caller's transaction that a job's effect joined: committed yet, and what then."""

    def __init__(self) -> None:
        self.committed = False
        self._then: Callable[[], None] | None = None

    def commit(self) -> None:
        """The caller's transaction committed: run what waits for it (once)."""
        self.committed = True
        then, self._then = self._then, None
        if then is not None:
            then()

    def then(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the caller's transaction commits (now, if it has); never if it
        rolls back."""
        if self.committed:
            callback()
        else:
            self._then = callback


@dataclass(frozen=True)
class JobContext:
    """What a guarded job knows about itself. Pass `fence` into every downstream write."""

    key: str
    fingerprint: str
    lease: Lease
    task_id: str = ""
    slot: Lease | None = None  # the concurrency slot (concurrency=N), with a fence of its own
    # The callers' transactions the job's effects committed into (as savepoints): the lock
    # server's record waits for them. Empty when the effects committed on their own.
    outer: list[OuterCommit] = field(default_factory=list, compare=False, repr=False)

    @property
    def fence(self) -> int:
        return self.lease.fence

    def check(self) -> None:
        """Raise LeaseLost if the lease is gone; call before long or unfenced steps."""
        self.lease.check()

    def join_outer(self) -> OuterCommit:
        """The job's effect (and its DONE row) commits with a caller's transaction.

        The effects layer calls `commit()` on what this returns from that transaction's
        after-commit hook (Django's `on_commit`, a Session's `after_commit`); on rollback it
        never calls it. The executor writes no lock-server record before then (design §9).
        """
        outer = OuterCommit()
        self.outer.append(outer)
        return outer


_current: ContextVar[JobContext | None] = ContextVar("jobfence_current_job", default=None)


def current_job() -> JobContext:
    job = _current.get()
    if job is None:
        raise LockError("no jobfence job is running here; call inside a @singleton_task")
    return job


def current_lease() -> Lease:
    return current_job().lease


def set_current(job: JobContext | None) -> object:
    return _current.set(job)


def reset_current(token: object) -> None:
    _current.reset(token)  # type: ignore[arg-type]
