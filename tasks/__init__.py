"""Idempotency keys, the lock-gated executor and @singleton_task for Celery.

The SQL effects (SqlEffects, EffectTx, make_engine) are imported on first use, so a task on
Redis locks never loads SQLAlchemy."""

from typing import TYPE_CHECKING

from jobfence.lazy import lazy_exports
from jobfence.tasks.celery_task import HEADER, SingletonTask, singleton_task
from jobfence.tasks.context import JobContext, current_job, current_lease
from jobfence.tasks.errors import (
    ArgumentsNotSerializable,
    BadArguments,
    DuplicateJob,
    DuplicatePublish,
    DuplicateSkipped,
    IdempotencyConflict,
    JobDropped,
    JobNotSettled,
    JobSkipped,
    JobSuperseded,
    PoisonMessage,
    RateLimitSkipped,
    TaskDefinitionError,
    TaskError,
)
from jobfence.tasks.executor import (
    DROPPED,
    DUPLICATE,
    SUPERSEDED,
    Executor,
    JobSpec,
    Outcome,
    Redelivery,
    RedeliveryLimitReached,
)
from jobfence.tasks.runtime import Runtime, install, installed, runtime_for

if TYPE_CHECKING:
    from jobfence.tasks.effects import EffectTx, SqlEffects, make_engine
    from jobfence.tasks.redis_effects import RedisEffects, RedisEffectTx

__getattr__, __dir__ = lazy_exports(
    __name__,
    dict.fromkeys(["EffectTx", "SqlEffects", "make_engine"], "jobfence.tasks.effects")
    | dict.fromkeys(["RedisEffectTx", "RedisEffects"], "jobfence.tasks.redis_effects"),
)

__all__ = [
    "DROPPED",
    "DUPLICATE",
    "HEADER",
    "SUPERSEDED",
    "ArgumentsNotSerializable",
    "BadArguments",
    "DuplicateJob",
    "DuplicatePublish",
    "DuplicateSkipped",
    "EffectTx",
    "Executor",
    "IdempotencyConflict",
    "JobContext",
    "JobDropped",
    "JobNotSettled",
    "JobSkipped",
    "JobSpec",
    "JobSuperseded",
    "Outcome",
    "PoisonMessage",
    "RateLimitSkipped",
    "Redelivery",
    "RedeliveryLimitReached",
    "RedisEffectTx",
    "RedisEffects",
    "Runtime",
    "SingletonTask",
    "SqlEffects",
    "TaskDefinitionError",
    "TaskError",
    "current_job",
    "current_lease",
    "install",
    "installed",
    "make_engine",
    "runtime_for",
    "singleton_task",
]
