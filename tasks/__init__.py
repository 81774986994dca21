"""Idempotency keys, the lock-gated executor and @singleton_task for Celery."""

from jobfence.tasks.celery_task import HEADER, SingletonTask, singleton_task
from jobfence.tasks.context import JobContext, current_job, current_lease
from jobfence.tasks.effects import EffectTx, SqlEffects, make_engine
from jobfence.tasks.errors import (
    ArgumentsNotSerializable,
    DuplicateJob,
    IdempotencyConflict,
    TaskError,
)
from jobfence.tasks.executor import DUPLICATE, SUPERSEDED, Executor, JobSpec, Outcome
from jobfence.tasks.runtime import Runtime, install, installed, runtime_for

__all__ = [
    "DUPLICATE",
    "HEADER",
    "SUPERSEDED",
    "ArgumentsNotSerializable",
    "DuplicateJob",
    "EffectTx",
    "Executor",
    "IdempotencyConflict",
    "JobContext",
    "JobSpec",
    "Outcome",
    "Runtime",
    "SingletonTask",
    "SqlEffects",
    "TaskError",
    "current_job",
    "current_lease",
    "install",
    "installed",
    "make_engine",
    "runtime_for",
    "singleton_task",
]
