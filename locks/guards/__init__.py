"""Fence guards: check-and-advance a resource's fencing token inside the caller's transaction
(SQL: guards/sql.py) or the caller's write (Redis: guards/redis.py)."""

from __future__ import annotations

from jobfence.locks.guards.args import check_args
from jobfence.locks.guards.redis import (
    AsyncRedisFenceGuard,
    JobRecordArgs,
    RecordedWrite,
    RedisFenceGuard,
)
from jobfence.locks.guards.sql import (
    UPSERT_DIALECTS,
    AsyncSqlFenceGuard,
    SqlFenceGuard,
    advance_upsert,
    commit_unknown,
    fences,
    last_fence,
    metadata,
)

__all__ = ["UPSERT_DIALECTS", "AsyncRedisFenceGuard", "AsyncSqlFenceGuard", "JobRecordArgs",
           "RecordedWrite", "RedisFenceGuard", "SqlFenceGuard", "advance_upsert", "check_args",
           "commit_unknown", "fences", "last_fence", "metadata"]  # fmt: skip
