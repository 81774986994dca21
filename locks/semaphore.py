"""Counting semaphores: waiting for a slot in arrival order, on any backend that keeps them."""

from __future__ import annotations

import contextlib

from jobfence.locks.acquire import Backoff
from jobfence.locks.backend import LockBackend, validate_seconds
from jobfence.locks.errors import AcquireTimeout, BackendUnavailable
from jobfence.locks.lease import OwnerMeta, new_owner_token
from jobfence.locks.slots import HEAD_POLL, MAX_POLL, WAITER_TTL, SlotLease


def acquire_slot(
    backend: LockBackend,
    key: str,
    *,
    limit: int,
    ttl: float,
    timeout: float,
    backoff: Backoff | None = None,
    meta: OwnerMeta | None = None,
) -> SlotLease:
    """Take a slot of `key`, waiting up to `timeout` seconds in the queue. Raises AcquireTimeout.

    The first attempt takes a place in the queue (a ticket); later polls keep it alive and
    take a slot once fewer than the free slots wait ahead. On timeout, or any error, the
    place is given up so nobody waits behind a waiter that left.
    """
    validate_seconds(timeout, "timeout")
    backoff = backoff or Backoff()
    clock = backend.clock
    deadline = clock.monotonic() + timeout
    owner = new_owner_token()
    queue = WAITER_TTL if timeout > 0 else 0.0
    attempt = 0
    try:
        while True:
            got = backend.semaphore_attempt(
                key, limit, ttl, owner=owner, meta=meta, queue_ttl=queue
            )
            if isinstance(got, SlotLease):
                return got
            left = deadline - clock.monotonic()
            if left <= 0:
                raise AcquireTimeout(
                    f"no semaphore slot within {timeout:g}s (limit {limit}, "
                    f"{max(got.position, 0)} waiting ahead)",
                    key=key,
                )
            # Those next in line poll fast (a freed slot waits for them alone); each further
            # `limit` waiters ahead doubles the pause, up to MAX_POLL.
            rank = max(got.position, 0) // limit
            cap = min(MAX_POLL, HEAD_POLL * (2 ** min(rank, 8)))
            step = min(cap, backoff.base * (2 ** min(attempt, 16)))
            wait = min(left, got.ttl_left + 0.001, max(backoff.rng.uniform(step / 2, step), 0.001))
            clock.sleep(wait)
            attempt += 1
    except BaseException:
        if queue:
            with contextlib.suppress(BackendUnavailable):  # else it lapses after WAITER_TTL
                backend.semaphore_leave(key, owner)
        raise
