"""The running job as the task body sees it: lease, fence and idempotency key."""

from __future__ import annotations

import hashlib
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


#: The longest DONE-row key the effect tables hold (jobfence_jobs.job_key).
RECORD_KEY_MAX = 255


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
    # One entry per effects block the body opened (SqlEffects, DjangoEffects): True where the
    # job's own DONE row answered it (it took effect in an earlier delivery), False where it
    # wrote. A body whose every block was answered ran again without taking effect again.
    effects: list[bool] = field(default_factory=list, compare=False, repr=False)
    # The job's (key, fingerprint) under each previous key secret of a rotation: its
    # effects' DONE rows written under an older secret answer it too.
    previous: tuple[tuple[str, str], ...] = ()
    # Set by the shell that runs the body: gives the lease back through the job's flow.
    let_go: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    # Per run (lock_until="start", unique_for, debounce): each publish is a run of its own,
    # so its effects' DONE rows are the run's (`record_key`), not the key's.
    per_run: bool = False

    @classmethod
    def of(
        cls, key: str, fingerprint: str, lease: Lease, task_id: str, slot: Lease | None,
        previous: tuple[tuple[str, str], ...], per_run: bool = False,
    ) -> JobContext:  # fmt: skip
        """What the generated __init__ builds, filled directly: a frozen dataclass's
        __init__ sets each field through object.__setattr__, the most of any step of a
        delivery's context (every job builds one)."""
        ctx = object.__new__(cls)
        ctx.__dict__.update(key=key, fingerprint=fingerprint, lease=lease, task_id=task_id,
                            slot=slot, outer=[], effects=[], previous=previous,
                            let_go=None, per_run=per_run)  # fmt: skip
        return ctx

    @property
    def record_key(self) -> str:
        """The key of this job's effect DONE rows: the job's key, or per run the run's
        (issue 34: a debounced burst's second run, with newer arguments, met the first
        run's row as "the key used with other arguments"; one with the same arguments was
        answered by it and took no effect)."""
        return self.record_key_of(self.key)

    def record_key_of(self, key: str) -> str:
        """`record_key` for the job's key `key` (its own, or one under an earlier secret)."""
        if not self.per_run:
            return key
        run = f"{key}#{self.task_id}"
        return run if len(run) <= RECORD_KEY_MAX else hashlib.sha256(run.encode()).hexdigest()

    @property
    def fence(self) -> int:
        return self.lease.fence

    def release_now(self) -> None:
        """Give the lease back before the body ends (a retry goes out, and its copy must not
        wait on it); the job's flow does it, and later does not release it twice."""
        if self.let_go is not None:
            self.let_go()

    def check(self) -> None:
        """Raise LeaseLost if the lease is gone; call before long or unfenced steps."""
        self.lease.check()

    def guarded_rows(self, resources: tuple[str, ...]) -> list[tuple[str, int]]:
        """The fence rows an effect transaction takes, in the one order every transaction
        uses (no deadlocks): each resource at the job's fence and, during a key rotation,
        a row per key of the job under each secret at fence 0 (a plain row lock). Two copies
        of one job gated under two secrets hold different keys and may both run after the
        lock server lost its data; the rows serialize their effect transactions, so the
        second finds the first's DONE row under the other key and replays it (seed
        `two-secrets-after-a-flush-commit-side-by-side`)."""
        rows = {resource: self.fence for resource in resources}
        if self.previous:
            for key in (self.key, *(k for k, _ in self.previous)):
                digest = hashlib.sha256(key.encode()).hexdigest()[:40]  # any task name's length
                rows.setdefault(f"jobfence:job:{digest}", 0)
        return sorted(rows.items())

    def effect_opened(self, answered: bool) -> None:
        """The effects layer opened a block: `answered` if the job's DONE row was there."""
        self.effects.append(answered)

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
