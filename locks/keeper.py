"""LeaseKeeper: one thread per process extends every held lease, one round trip per backend."""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import LeaseLost
from jobfence.locks.lease import Lease

if TYPE_CHECKING:
    from jobfence.locks.backend import LockBackend

log = logging.getLogger(__name__)

LostCallback = Callable[[Lease, BaseException], None]
ExtendObserver = Callable[[str, float, int], None]  # backend name, seconds, leases


class LeaseKeeper:
    """Extends held leases every `fraction` of their TTL until released, lost or dropped.

    Leases are held by weak reference: a lease its caller dropped is not kept alive.
    A failed extension marks the batch lost at once (a lease we could not confirm is
    one we cannot trust); a lease past its deadline is marked lost too. Loss fires the
    lease's callbacks and `on_lost`, and `lease.check()` raises from then on.
    """

    def __init__(
        self,
        *,
        fraction: float = 1 / 3,
        clock: Clock = SYSTEM_CLOCK,
        on_lost: LostCallback | None = None,
        on_extend: ExtendObserver | None = None,
        name: str = "jobfence-keeper",
    ) -> None:
        if not 0 < fraction < 0.5:
            raise ValueError(f"keeper fraction must be in (0, 0.5), got {fraction}")
        self.fraction = fraction
        self.clock = clock
        self.on_lost = on_lost
        self.on_extend = on_extend
        self.name = name
        self._reset()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (k := ref()) and k._reset())  # type: ignore[func-returns-value]

    def _reset(self) -> None:
        # After fork the parent's thread is gone and its leases are not the child's to keep.
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._due: weakref.WeakKeyDictionary[Lease, float] = weakref.WeakKeyDictionary()
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf  # when the thread will next wake by itself (inf: awake)

    # -- public ----------------------------------------------------------------
    def start(self) -> None:
        """Start the thread now (it also starts on the first `keep`); idempotent."""
        with self._mutex:
            self._start_locked()

    def keep(self, lease: Lease) -> None:
        """Start extending `lease` every fraction of its TTL."""
        if self.on_lost is not None:
            lease.on_lost(self.on_lost)
        with self._mutex:
            due = self.clock.monotonic() + lease.ttl * self.fraction
            self._due[lease] = due
            self._start_locked()
            # Wake the thread only if it would sleep past this lease's first extension: a
            # wake-up for every job is a thread switch on the hot path, for nothing.
            wake = due < self._wake_at
        if wake:
            self._wake.set()

    def _start_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._wake_at = math.inf  # a new thread ticks at once
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def drop(self, lease: Lease) -> None:
        """Stop extending `lease` (it is being released)."""
        with self._mutex:
            self._due.pop(lease, None)

    def held(self) -> list[Lease]:
        with self._mutex:
            return list(self._due.keys())

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    # -- the thread -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.tick()
            except Exception:  # never die silently: log, and keep keeping
                log.exception("lease keeper tick failed")
                wait = 0.05
            with self._mutex:  # `keep` wakes us if something falls due before this
                self._wake_at = self.clock.monotonic() + wait
            self._wake.wait(wait)
            with self._mutex:  # awake: the next tick sees whatever `keep` adds now
                self._wake_at = math.inf
            self._wake.clear()

    def tick(self) -> float:
        """Extend what is due; return seconds until the next thing is due."""
        now = self.clock.monotonic()
        batches: dict[int, tuple[LockBackend, list[Lease]]] = {}
        next_wake = 1.0
        with self._mutex:
            for lease, due in list(self._due.items()):
                if lease.released or lease.lost:
                    if not lease.released and lease.remaining() <= 0:
                        lease.mark_lost(
                            LeaseLost(
                                "lease deadline passed before extension",
                                key=lease.key,
                                fence=lease.fence,
                            )
                        )
                    del self._due[lease]
                    continue
                # Coalesce: whatever falls due within half an interval goes in this batch.
                interval = lease.ttl * self.fraction
                if due - now <= interval / 2:
                    batches.setdefault(id(lease.backend), (lease.backend, []))[1].append(lease)
                    self._due[lease] = now + interval
                    next_wake = min(next_wake, interval)
                else:
                    next_wake = min(next_wake, due - now)
        for backend, leases in batches.values():
            self._extend_batch(backend, leases)
        return max(0.001, next_wake)

    def _extend_batch(self, backend: LockBackend, leases: list[Lease]) -> None:
        started = self.clock.monotonic()
        try:
            backend.extend_many(leases)  # marks refused leases lost itself
        except Exception as exc:
            log.warning(
                "lease extension failed on %s for %d lease(s): %s",
                backend.name,
                len(leases),
                type(exc).__name__,
            )
            for lease in leases:
                lease.mark_lost(
                    LeaseLost("lease extension failed", key=lease.key, fence=lease.fence, cause=exc)
                )
            return
        if self.on_extend is not None:
            self.on_extend(backend.name, self.clock.monotonic() - started, len(leases))
