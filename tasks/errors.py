"""Errors raised by the task layer: conflicts, duplicates and unusable arguments."""

from __future__ import annotations

from jobfence.locks.errors import LockError


class TaskError(LockError):
    """Root of task-layer errors (a LockError, so it carries key, fence and cause)."""


class IdempotencyConflict(TaskError):
    """The same idempotency key arrived with other arguments than the finished job had."""


class DuplicateJob(TaskError):
    """The job is running elsewhere and the conflict policy is `raise`."""


class ArgumentsNotSerializable(TaskError, TypeError):
    """A task argument cannot be encoded as JSON; raised at publish time."""


class NotInstalled(TaskError):
    """The Celery app has no jobfence runtime; call tasks.install(app, settings)."""


class PoisonMessage(TaskError):
    """A job's deliveries kept losing their worker mid-body; it is recorded FAILED, not rerun."""
