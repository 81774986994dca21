"""Leases with fencing tokens, a heartbeat keeper, blocking acquire and fence guards.

The Redis backend and the fence guards are imported on first use, so importing this package
loads neither redis-py nor SQLAlchemy."""

from typing import TYPE_CHECKING

from jobfence.lazy import lazy_exports
from jobfence.locks.acquire import Backoff, acquire
from jobfence.locks.api import Locker, open_backend
from jobfence.locks.backend import (
    Busy,
    Capabilities,
    Health,
    JobRecord,
    LockBackend,
    LockInfo,
    Security,
)
from jobfence.locks.backends.memory import MemoryBackend
from jobfence.locks.clock import SYSTEM_CLOCK, Clock, ManualClock, SystemClock
from jobfence.locks.errors import (
    AcquireTimeout,
    BackendUnavailable,
    CommitOutcomeUnknown,
    FencedWriteRefused,
    LeaseLost,
    LockError,
    NotOwner,
    PartialFencedWrite,
    RateLimited,
    RateLimitUnsupported,
    SemaphoreUnsupported,
    StaleFence,
    StaleFenceOutcomeUnknown,
)
from jobfence.locks.keeper import LeaseKeeper
from jobfence.locks.leader import LeaderElector, Term
from jobfence.locks.lease import Lease, OwnerMeta
from jobfence.locks.ratelimit import Rate, RateLimiter, parse_rate
from jobfence.locks.semaphore import acquire_slot
from jobfence.locks.slots import SlotInfo, SlotLease, SlotWait

if TYPE_CHECKING:
    from jobfence.locks.aio import AsyncLocker
    from jobfence.locks.backends.redis import RedisBackend
    from jobfence.locks.guards import (
        AsyncRedisFenceGuard,
        AsyncSqlFenceGuard,
        RedisFenceGuard,
        SqlFenceGuard,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "AsyncLocker": "jobfence.locks.aio",
        "AsyncRedisFenceGuard": "jobfence.locks.guards",
        "AsyncSqlFenceGuard": "jobfence.locks.guards",
        "RedisBackend": "jobfence.locks.backends.redis",
        "RedisFenceGuard": "jobfence.locks.guards",
        "SqlFenceGuard": "jobfence.locks.guards",
    },
)

__all__ = [
    "SYSTEM_CLOCK",
    "AcquireTimeout",
    "AsyncLocker",
    "AsyncRedisFenceGuard",
    "AsyncSqlFenceGuard",
    "BackendUnavailable",
    "Backoff",
    "Busy",
    "Capabilities",
    "Clock",
    "CommitOutcomeUnknown",
    "FencedWriteRefused",
    "Health",
    "JobRecord",
    "LeaderElector",
    "Lease",
    "LeaseKeeper",
    "LeaseLost",
    "LockBackend",
    "LockError",
    "LockInfo",
    "Locker",
    "ManualClock",
    "MemoryBackend",
    "NotOwner",
    "OwnerMeta",
    "PartialFencedWrite",
    "Rate",
    "RateLimitUnsupported",
    "RateLimited",
    "RateLimiter",
    "RedisBackend",
    "RedisFenceGuard",
    "Security",
    "SemaphoreUnsupported",
    "SlotInfo",
    "SlotLease",
    "SlotWait",
    "SqlFenceGuard",
    "StaleFence",
    "StaleFenceOutcomeUnknown",
    "SystemClock",
    "Term",
    "acquire",
    "acquire_slot",
    "open_backend",
    "parse_rate",
]
