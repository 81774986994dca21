"""Errors raised by the task layer: conflicts, duplicates and unusable arguments."""

from __future__ import annotations

from typing import ClassVar

from jobfence.config.errors import JobfenceError
from jobfence.locks.errors import KeyedError


class TaskError(KeyedError):
    """Root of task-layer errors; carries key, fence and cause. `except LockError` never
    catches one: a conflict is not a lock failure."""


class IdempotencyConflict(TaskError):
    """The same idempotency key arrived with other arguments than the finished job had."""


class DuplicateJob(TaskError):
    """The job is running elsewhere and the conflict policy is `raise`."""


class DuplicatePublish(DuplicateJob):
    """A publish found a copy of the job already queued or running, and the task says
    `on_duplicate_publish="raise"`. `task_id` is that copy's (the holder's) task id."""

    def __init__(self, message: str, *, task_id: str, key: str | None = None) -> None:
        self.task_id = task_id
        super().__init__(message, key=key)


class BadArguments(TaskError, TypeError):
    """The arguments do not fit the task: an unknown keyword, a missing argument, or one that
    cannot be a key. Raised at publish or call, as a plain call would raise its TypeError."""


class ArgumentsNotSerializable(BadArguments):
    """A task argument cannot be encoded as JSON; the message names it, never its value."""


class TaskDefinitionError(JobfenceError, ValueError):
    """`@singleton_task` options that cannot work (a key naming no parameter, a bad policy);
    raised at decoration, where the mistake is."""


class NotInstalled(TaskError):
    """The runtime lacks something a task needs (JOBFENCE_DATABASE_URL for the effects)."""


class PoisonMessage(TaskError):
    """A job's deliveries kept losing their worker mid-body; it is recorded FAILED, not rerun."""


class JobSkipped(TaskError):
    """The delivery ended without a result of its own, so nothing may flow on as one: the
    caller's `.get()` raises it and a chain, group, chord or `link` stops there (`link_error`
    runs). `marker` is the dict such a delivery returned in 0.1, for code that read it.

    Raised in the worker and rebuilt by Celery from the result backend, so it keeps only its
    message (and `task_id` or `retry_after`) in `args`; `key` is set where it was raised."""

    marker: ClassVar[dict[str, str]] = {"jobfence": "skipped"}

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message, key=key)


class DuplicateSkipped(JobSkipped, DuplicateJob):
    """`on_conflict="skip"`: a copy of the job was running (or, with `unique_for`, ran within
    the window), so this one was acked without running. `task_id` is that copy's task id
    (empty where unknown): its `AsyncResult` answers with the job's result."""

    marker: ClassVar[dict[str, str]] = {"jobfence": "duplicate"}

    def __init__(self, message: str, task_id: str = "", *, key: str | None = None) -> None:
        super().__init__(message, key=key)
        self.task_id = task_id
        self.args = (str(self), task_id)  # what Celery stores, and rebuilds it from

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class JobSuperseded(JobSkipped):
    """A newer copy took the job over (`on_duplicate_publish="replace"`, `debounce`, or proof
    on the lock: a stale fence, another holder) before its result was on record; this copy
    never ran, or stopped. `task_id` is the newer copy's where known (a replaced or debounced
    copy): its `AsyncResult` answers for this publish."""

    marker: ClassVar[dict[str, str]] = {"jobfence": "superseded"}

    def __init__(self, message: str, task_id: str = "", *, key: str | None = None) -> None:
        super().__init__(message, key=key)
        self.task_id = task_id
        self.args = (str(self), task_id)  # what Celery stores, and rebuilds it from


class JobDropped(JobSkipped):
    """`on_lease_lost="drop"`: the lease was lost mid-body and the job is not run again; it
    may have run in part."""

    marker: ClassVar[dict[str, str]] = {"jobfence": "dropped"}


class RateLimitSkipped(JobSkipped):
    """`on_rate_limited="skip"`: no turn of the global rate limit was free; the job did not
    run. `retry_after` is how many seconds until one is."""

    marker: ClassVar[dict[str, str]] = {"jobfence": "rate_limited"}

    def __init__(self, message: str, retry_after: float = 0.0, *, key: str | None = None) -> None:
        super().__init__(message, key=key)
        self.retry_after = float(retry_after)
        self.args = (str(self), self.retry_after)  # what Celery stores, and rebuilds it from

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class JobNotSettled(TaskError):
    """Eager or direct call: the job's fate is unknown and there is no broker to come back
    through (lock server unavailable, lease lost, commit unanswered). Call it again."""
