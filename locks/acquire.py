"""Blocking acquire for every backend: a deadline, full-jitter backoff, and wake-up on release."""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field

from jobfence.locks.backend import LockBackend, validate_seconds
from jobfence.locks.errors import AcquireTimeout, LockError
from jobfence.locks.lease import Lease, OwnerMeta


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
    validate_seconds(timeout, "timeout", forever=True)
    backoff = backoff or Backoff()
    clock = backend.clock
    deadline = clock.monotonic() + timeout
    attempt = 0
    while True:
        got = backend.attempt(key, ttl, meta=meta)
        if isinstance(got, Lease):
            return got
        if cancel is not None and cancel.is_set():
            raise AcquireTimeout("the wait was cancelled", key=key)
        left = deadline - clock.monotonic()
        if left <= 0:
            raise AcquireTimeout(f"not acquired within {timeout:g}s", key=key)
        # Jitter spreads waiters that poll for an expiry; a release wakes one at once.
        wait = min(left, got.ttl_left + 0.001, max(backoff.delay(attempt), 0.001))
        backend.wait_for_release(key, wait)
        attempt += 1
