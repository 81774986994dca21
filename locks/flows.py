"""The lock logic as I/O-free generators: they validate, decide and yield ops (locks/ops.py).

A flow never touches a socket, a clock or a thread: `locks/drive.py` runs it, sync or
asyncio, and a test runs it by hand, sending each reply (`flow.send(Busy(...))`) or
throwing a failure into it (`flow.throw(BackendUnavailable(...))`). One source for the
Locker, the AsyncLocker, the leader campaign and the rate limiter.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from jobfence.locks.backend import Busy, RateGrant, validate_seconds
from jobfence.locks.errors import AcquireTimeout, BackendUnavailable, LockError, RateLimited
from jobfence.locks.lease import Lease, OwnerMeta, new_owner_token
from jobfence.locks.ops import (
    NOW,
    Acquire,
    LeaveSlot,
    Op,
    ReleaseOwner,
    Sleep,
    TakeRate,
    TakeSlot,
    WaitRelease,
)
from jobfence.locks.slots import HEAD_POLL, MAX_POLL, WAITER_TTL, SlotLease, SlotWait

if TYPE_CHECKING:
    from jobfence.locks.ratelimit import Rate

T = TypeVar("T")
#: A flow: yields ops, is sent each op's reply, returns its value.
Flow = Generator[Op, Any, T]


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: sleep uniform(0, min(cap, base * 2**attempt))."""

    base: float = 0.005
    cap: float = 0.5
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap or not math.isfinite(self.cap):  # NaN fails 0 < x
            raise LockError(f"backoff needs 0 < base <= cap, got base={self.base} cap={self.cap}")

    def delay(self, attempt: int) -> float:
        return self.rng.uniform(0, min(self.cap, self.base * (2 ** min(attempt, 32))))


def acquire_flow(
    key: str,
    *,
    ttl: float,
    timeout: float,
    backoff: Backoff | None = None,
    meta: OwnerMeta | None = None,
    blocking: bool = True,
    cancelled: Callable[[], bool] | None = None,
) -> Flow[Lease]:
    """Acquire `key`, waiting up to `timeout` seconds (math.inf: for ever); AcquireTimeout
    after it, or once `cancelled()` says so (asked between attempts).

    Between attempts the waiter waits on the store's release signal, bounded by the
    jittered backoff, the holder's remaining TTL and the deadline, so a release wakes it
    at once and an expiry is noticed within one backoff step. `blocking=False` tries once.
    """
    validate_seconds(timeout, "timeout", forever=True)
    backoff = backoff or Backoff()
    owner = new_owner_token()
    deadline = (yield NOW) + timeout
    attempt = 0
    while True:
        try:
            got = yield Acquire(key, ttl, owner, meta)
        except (Exception, GeneratorExit):
            raise  # a lost reply: a grant made meanwhile lapses after its TTL
        except BaseException:
            # Cancelled mid-request: the server may have granted it; free it now, not at TTL.
            with contextlib.suppress(Exception):
                yield ReleaseOwner(key, owner)
            raise
        if isinstance(got, Lease):
            return got
        busy: Busy = got
        if not blocking:
            raise AcquireTimeout("held by another owner", key=key)
        if cancelled is not None and cancelled():
            raise AcquireTimeout("the wait was cancelled", key=key)
        left = deadline - (yield NOW)
        if left <= 0:
            raise AcquireTimeout(f"not acquired within {timeout:g}s", key=key)
        # Jitter spreads waiters that poll for an expiry; a release wakes one at once.
        wait = min(left, busy.ttl_left + 0.001, max(backoff.delay(attempt), 0.001))
        yield WaitRelease(key, wait)
        attempt += 1


def slot_flow(
    key: str,
    *,
    limit: int,
    ttl: float,
    timeout: float,
    backoff: Backoff | None = None,
    meta: OwnerMeta | None = None,
) -> Flow[SlotLease]:
    """Take a slot of `key`, waiting up to `timeout` seconds in the queue; AcquireTimeout.

    The first attempt takes a place in the queue (a ticket); later polls keep it alive and
    take a slot once fewer than the free slots wait ahead. On timeout, cancellation or any
    error the place is given up, so nobody waits behind a waiter that left; so is a slot
    whose grant was never read (the flow ended while its TakeSlot was out).
    """
    validate_seconds(timeout, "timeout")
    backoff = backoff or Backoff()
    deadline = (yield NOW) + timeout
    owner = new_owner_token()
    queue = WAITER_TTL if timeout > 0 else 0.0
    attempt = 0
    unanswered = False  # a TakeSlot is out and its reply unread: it may have granted a slot
    try:
        while True:
            unanswered = True
            got = yield TakeSlot(key, limit, ttl, owner, meta, queue)
            unanswered = False
            if isinstance(got, SlotLease):
                return got
            wait_info: SlotWait = got
            left = deadline - (yield NOW)
            if left <= 0:
                raise AcquireTimeout(
                    f"no semaphore slot within {timeout:g}s (limit {limit}, "
                    f"{max(wait_info.position, 0)} waiting ahead)",
                    key=key,
                )
            # Those next in line poll fast (a freed slot waits for them alone); each further
            # `limit` waiters ahead doubles the pause, up to MAX_POLL.
            rank = max(wait_info.position, 0) // limit
            cap = min(MAX_POLL, HEAD_POLL * (2 ** min(rank, 8)))
            step = min(cap, backoff.base * (2 ** min(attempt, 16)))
            pause = backoff.rng.uniform(step / 2, step)
            yield Sleep(min(left, wait_info.ttl_left + 0.001, max(pause, 0.001)))
            attempt += 1
    except GeneratorExit:
        raise  # closed unrun: nothing to send
    except BaseException:
        # A ticket in the queue, or a TakeSlot whose grant we never read (a try cancelled
        # mid-request): give it up now, else it is held until WAITER_TTL or the slot's TTL.
        if queue or unanswered:
            with contextlib.suppress(BackendUnavailable):
                yield LeaveSlot(key, owner)
        raise


def campaign_flow(
    key: str,
    *,
    ttl: float,
    timeout: float | None = None,
    backoff: Backoff | None = None,
    meta: OwnerMeta,
    cancelled: Callable[[], bool] | None = None,
) -> Flow[Lease]:
    """One campaign of an election: wait until this process holds `key` (for ever unless
    `timeout`); the shell turns the lease into a Term."""
    return (
        yield from acquire_flow(
            key,
            ttl=ttl,
            timeout=math.inf if timeout is None else timeout,
            backoff=backoff,
            meta=meta,
            cancelled=cancelled,
        )
    )


def rate_flow(key: str, rate: Rate, *, timeout: float | None) -> Flow[RateGrant]:
    """Reserve our turn on the limiter `key` (one round trip), then sleep it out; RateLimited
    if it is more than `timeout` seconds away (None: no bound)."""
    max_wait = math.inf if timeout is None else timeout
    grant: RateGrant = yield TakeRate(key, rate.interval, rate.burst, max_wait)
    if not grant.admitted:
        raise RateLimited(
            f"rate limit {rate} not available within {max_wait:g}s",
            key=key,
            retry_after=grant.wait,
        )
    if grant.wait > 0:
        yield Sleep(grant.wait)
    return grant
