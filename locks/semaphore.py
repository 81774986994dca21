"""Counting semaphores: waiting for a slot in arrival order, on any backend that keeps them.

The logic is `locks/flows.py::slot_flow`; this runs it in the calling thread."""

from __future__ import annotations

from jobfence.locks.backend import LockBackend
from jobfence.locks.drive import run_sync
from jobfence.locks.flows import Backoff, slot_flow
from jobfence.locks.lease import OwnerMeta
from jobfence.locks.slots import SlotLease


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
    flow = slot_flow(key, limit=limit, ttl=ttl, timeout=timeout, backoff=backoff, meta=meta)
    return run_sync(flow, backend, backend.clock)
