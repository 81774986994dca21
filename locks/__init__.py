"""Leases with fencing tokens, a heartbeat keeper, blocking acquire and fence guards."""

from locks.acquire import Backoff, acquire
from locks.api import Locker, open_backend
from locks.backend import Busy, Capabilities, JobRecord, LockBackend, LockInfo
from locks.clock import SYSTEM_CLOCK, Clock, ManualClock, SystemClock
from locks.errors import (
    AcquireTimeout,
    BackendUnavailable,
    LeaseLost,
    LockError,
    NotOwner,
    StaleFence,
)
from locks.guards import RedisFenceGuard, SqlFenceGuard
from locks.keeper import LeaseKeeper
from locks.lease import Lease, OwnerMeta
from locks.memory_backend import MemoryBackend
from locks.redis_backend import RedisBackend

__all__ = [
    "SYSTEM_CLOCK",
    "AcquireTimeout",
    "BackendUnavailable",
    "Backoff",
    "Busy",
    "Capabilities",
    "Clock",
    "JobRecord",
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
    "RedisBackend",
    "RedisFenceGuard",
    "SqlFenceGuard",
    "StaleFence",
    "SystemClock",
    "acquire",
    "open_backend",
]
