"""LockBackend.execute's ops off a lease's path (slots, rates, the admin read, publish claims,
job records, delivery counts): each run as the public method that makes its round trip."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobfence.locks.errors import LockError
from jobfence.locks.ops import (
    ClaimPublish,
    ClearPublish,
    CountDelivery,
    Inspect,
    LeaveSlot,
    ReadRecord,
    ReleaseGrant,
    StoreOp,
    SwapPublish,
    TakeRate,
    TakeSlot,
)

if TYPE_CHECKING:  # only types: that module imports this one
    from jobfence.locks.backend import LockBackend


def run_other_op(backend: LockBackend, op: StoreOp) -> Any:
    """The reply of `op` (one round trip), as `LockBackend.execute` gives it; LockError for
    an op no backend runs."""
    match op:
        case TakeSlot(key, limit, ttl, owner, meta, queue_ttl):
            return backend.semaphore_attempt(
                key, limit, ttl, owner=owner, meta=meta, queue_ttl=queue_ttl
            )
        case LeaveSlot(key, owner):
            return backend.semaphore_leave(key, owner)
        case TakeRate(key, interval, burst, max_wait):
            return backend.take_rate(key, interval, burst, max_wait)
        case Inspect(key):
            return backend.inspect(key)
        case ReleaseGrant(key, fence):
            return backend.release_grant(key, fence)
        case ClaimPublish(key, task_id, ttl):
            return backend.claim_publish(key, task_id, ttl)
        case SwapPublish(key, expect, new, ttl):
            return backend.swap_publish(key, expect, new, ttl)
        case ClearPublish(key):
            backend.clear_publish(key)
            return None
        case ReadRecord(key):
            return backend.job_record(key)
        case CountDelivery(key, window):
            return backend.count_delivery(key, window)
    raise LockError(f"the {backend.name} lock backend cannot run {type(op).__name__}")
