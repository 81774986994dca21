"""Blocking acquire for every backend: a deadline, full-jitter backoff, and wake-up on release.

The logic is `locks/flows.py::acquire_flow`; this runs it in the calling thread."""

from __future__ import annotations

import threading

from jobfence.locks.backend import LockBackend
from jobfence.locks.drive import run_sync
from jobfence.locks.flows import Backoff, acquire_flow
from jobfence.locks.lease import Lease, OwnerMeta

__all__ = ["Backoff", "acquire"]


def acquire(
    backend: LockBackend,
    key: str,
    *,
    ttl: float,
    timeout: float,
    backoff: Backoff | None = None,
    meta: OwnerMeta | None = None,
    cancel: threading.Event | None = None,
) -> Lease:
    """Acquire `key`, waiting up to `timeout` seconds (math.inf: forever). Raises AcquireTimeout,
    also once `cancel` is set (noticed between attempts, within one backoff step).

    Between attempts the waiter blocks on the backend's release signal, bounded by the
    jittered backoff, the holder's remaining TTL and the deadline, so a release wakes it
    at once and an expiry is noticed within one backoff step.
    """
    flow = acquire_flow(
        key,
        ttl=ttl,
        timeout=timeout,
        backoff=backoff,
        meta=meta,
        cancelled=None if cancel is None else cancel.is_set,
    )
    return run_sync(flow, backend, backend.clock)
