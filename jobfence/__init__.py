"""jobfence: Celery jobs that run at most once at a time across a fleet, effects applied once.

`setup(app)` gives your own Celery app the safe configuration, the start-up checks, the
lease keeper's signals and beat's leader election; `@singleton_task` alone also works,
with its runtime built from JOBFENCE_* on first use.

The public names live here; ``jobfence.config``, ``jobfence.locks``, ``jobfence.tasks`` and
``jobfence.worker`` hold the rest. Imports flow one way: config -> locks -> tasks -> worker.
Each name is imported on first use, so ``import jobfence.locks`` loads neither Celery nor
SQLAlchemy, and ``from jobfence import singleton_task`` loads no SQL library.
"""

from typing import TYPE_CHECKING

from jobfence.lazy import lazy_reexports

if TYPE_CHECKING:
    from jobfence.config import JobfenceError, Settings, UnsafeSettings, load_settings
    from jobfence.locks import (
        AcquireTimeout,
        AsyncLocker,
        AsyncSqlFenceGuard,
        BackendUnavailable,
        Lease,
        LeaseLost,
        Locker,
        LockError,
        NotOwner,
        RedisFenceGuard,
        SqlFenceGuard,
        StaleFence,
    )
    from jobfence.tasks import (
        ArgumentsNotSerializable,
        DuplicateSkipped,
        IdempotencyConflict,
        JobSkipped,
        SingletonTask,
        current_job,
        current_lease,
        install,
        singleton_task,
    )
    from jobfence.worker.setup import setup

__version__ = "0.1.0"

__all__ = [
    "AcquireTimeout",
    "ArgumentsNotSerializable",
    "AsyncLocker",
    "AsyncSqlFenceGuard",
    "BackendUnavailable",
    "DuplicateSkipped",
    "IdempotencyConflict",
    "JobSkipped",
    "JobfenceError",
    "Lease",
    "LeaseLost",
    "LockError",
    "Locker",
    "NotOwner",
    "RedisFenceGuard",
    "Settings",
    "SingletonTask",
    "SqlFenceGuard",
    "StaleFence",
    "UnsafeSettings",
    "__version__",
    "current_job",
    "current_lease",
    "install",
    "load_settings",
    "setup",
    "singleton_task",
]

# Each name comes from the first of these that has it (they import in this order anyway).
__getattr__, __dir__ = lazy_reexports(
    __name__,
    set(__all__) - {"__version__"},
    ["jobfence.config", "jobfence.locks", "jobfence.tasks", "jobfence.worker.setup"],
)
