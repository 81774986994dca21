"""Semaphore slot types: a slot is a Lease with a fence; waiters hold a place in a queue."""

from __future__ import annotations

from dataclasses import dataclass

from jobfence.locks.errors import LockError
from jobfence.locks.lease import Lease, OwnerMeta

#: A waiter's place in the queue is kept this long after its last poll: a waiter that died
#: holds up those behind it for this long at most. Waiters poll well within it.
WAITER_TTL = 5.0
#: The longest pause between a waiter's polls (its place must not lapse meanwhile).
MAX_POLL = 0.25
#: The longest pause of a waiter that a freed slot would go to (it is next in line).
HEAD_POLL = 0.02
MAX_LIMIT = 1_000_000


@dataclass(eq=False)
class SlotLease(Lease):
    """One slot of the semaphore `key`: kept, extended and released like a lock lease.

    `fence` is strictly greater than every earlier slot grant of the same semaphore.
    """

    limit: int = 0


@dataclass(frozen=True)
class SlotWait:
    """No slot yet: `position` waiters are ahead in the queue (-1: not queued); the
    earliest holder's lease ends in `ttl_left` seconds at the latest."""

    position: int
    ttl_left: float


@dataclass(frozen=True)
class SlotInfo:
    """What `semaphore_holders` reports of one held slot. The owner token never appears."""

    fence: int
    ttl_left: float
    host: str
    pid: int
    task_id: str
    task_name: str


def validate_limit(limit: int, key: str) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise LockError(
            f"semaphore limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}", key=key
        )
    return limit


def holder_text(meta: OwnerMeta) -> str:
    """host, pid, task id and task name, as slots store them (never the owner token)."""
    return f"{meta.host}\n{meta.pid}\n{meta.task_id}\n{meta.task_name}"


def parse_holder(fence: int, ttl_left: float, text: str) -> SlotInfo:
    host, pid, task_id, task_name = [*text.split("\n", 3), "", "", "", ""][:4]
    return SlotInfo(
        fence=fence,
        ttl_left=max(0.0, ttl_left),
        host=host,
        pid=int(pid or 0),
        task_id=task_id,
        task_name=task_name,
    )
