"""The running job as the task body sees it: lease, fence and idempotency key."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from jobfence.locks.errors import LockError
from jobfence.locks.lease import Lease


@dataclass(frozen=True)
class JobContext:
    """What a guarded job knows about itself. Pass `fence` into every downstream write."""

    key: str
    fingerprint: str
    lease: Lease
    task_id: str = ""
    slot: Lease | None = None  # the concurrency slot (concurrency=N), with a fence of its own

    @property
    def fence(self) -> int:
        return self.lease.fence

    def check(self) -> None:
        """Raise LeaseLost if the lease is gone; call before long or unfenced steps."""
        self.lease.check()


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
