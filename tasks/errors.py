"""Errors raised by the task layer: conflicts, duplicates and unusable arguments."""

from __future__ import annotations

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
