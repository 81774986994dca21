"""LeaseKeeper: one keeper per process extends every held lease, one round trip per backend."""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import LeaseLost
from jobfence.locks.lease import Lease
from jobfence.locks.outage import OUTAGE

if TYPE_CHECKING:
    from jobfence.locks.backend import LockBackend, Stoppable

log = logging.getLogger(__name__)

LostCallback = Callable[[Lease, BaseException], None]
ExtendObserver = Callable[[str, float, int], None]  # backend name, seconds, leases

#: Leases falling due within this fraction of an interval join the batch being sent, so
#: leases taken at nearby times share a round trip; small, so none is extended much early.
COALESCE_FRACTION = 0.1
#: After a failed extension, try again after this fraction of the interval (while the
#: lease's deadline leaves room): a blip costs one short delay, not the lease.
RETRY_FRACTION = 0.15
MIN_RETRY_DELAY = 0.01
#: The scheduler sleeps at most this long: every lease's due time and deadline wake it
#: sooner; each tick scans every held lease, which counts with thousands of them.
MAX_SLEEP = 5.0


# -- the schedule, pure: when a lease is due, what counts as lost, which leases go together.
# The thread keeper (below) and the asyncio keeper (locks/aio.py) both run on it.
def first_due(now: float, lease: Lease, fraction: float) -> float:
    """When a lease kept from `now` is first extended."""
    return now + lease.ttl * fraction


def next_due(chosen: float, lease: Lease, fraction: float) -> float:
    """After a confirmed extension of a batch chosen at `chosen`."""
    return chosen + lease.ttl * fraction


def retry_due(now: float, lease: Lease, fraction: float) -> float:
    """After a failed extension (unknown outcome, not a refusal): soon, not a whole interval."""
    return now + max(MIN_RETRY_DELAY, lease.ttl * fraction * RETRY_FRACTION)


def time_left(lease: Lease, now: float) -> float:
    """Seconds until the lease counts as lost (drift subtracted); <= 0: lost now."""
    return lease.deadline - lease.drift - now


def deadline_loss(lease: Lease) -> LeaseLost:
    return LeaseLost(
        "lease deadline passed before an extension was confirmed", key=lease.key, fence=lease.fence
    )


def pick_batch(
    entries: Sequence[tuple[Lease, float]], now: float, fraction: float
) -> tuple[list[Lease], float]:
    """One backend's live leases and due times -> (the batch to send now, seconds until one
    falls due if none is). Once one is due (less its coalescing slack), every lease due
    within one shortest interval goes along: a backend's leases settle into one phase."""
    shortest = trigger = earliest = math.inf
    for lease, due in entries:
        interval = lease.ttl * fraction
        shortest = min(shortest, interval)
        trigger = min(trigger, due - interval * COALESCE_FRACTION)
        earliest = min(earliest, due)
    if trigger > now:
        return [], earliest - now
    horizon = now + shortest
    return [lease for lease, due in entries if due <= horizon], math.inf


def _snapshot(due: weakref.WeakKeyDictionary[Lease, float]) -> list[tuple[Lease, float]]:
    """The live leases and their due times. WeakKeyDictionary.items() is a generator under
    an iteration guard, three times the cost of copying the dict of weak references it
    wraps (what counts with 10,000 leases scanned at every tick)."""
    refs: dict[weakref.ref[Lease], float] = due.data  # type: ignore[attr-defined]
    out = []
    for ref, when in list(refs.items()):
        lease = ref()
        if lease is not None:
            out.append((lease, when))
    return out


class _Lane:
    """One backend's extension thread: a slow or failing server only delays its own leases."""

    def __init__(self, keeper: LeaseKeeper, label: str) -> None:
        self.keeper = keeper
        self.busy = False
        self.skipped = False  # a tick passed this backend by while its call was in flight
        self._job: tuple[LockBackend, list[Lease], float] | None = None
        self._event = threading.Event()
        self.thread = threading.Thread(target=self._run, name=label, daemon=True)
        self.thread.start()

    def submit(self, backend: LockBackend, leases: list[Lease], chosen: float) -> None:
        """Hand over a batch; the caller holds the keeper's mutex and saw `busy` False."""
        self.busy = True
        self._job = (backend, leases, chosen)
        self._event.set()

    def wake(self) -> None:
        self._event.set()

    def _run(self) -> None:
        keeper = self.keeper
        while not keeper._stop.is_set():
            self._event.wait()
            self._event.clear()
            job, self._job = self._job, None
            if job is None:
                continue
            extended = False
            try:
                extended = keeper._extend_batch(*job)
            except Exception:  # never die silently: the scheduler retries what is left
                log.exception("lease keeper lane failed on %s", job[0].name)
            finally:
                del job  # no strong reference to the leases while idle
                with keeper._mutex:
                    self.busy = False
                    wake, self.skipped = self.skipped or not extended, False
                # A failed batch is retried soon, and a tick that skipped this backend while
                # it was busy may have left leases due: either way the scheduler looks again.
                # After a plain success every lease sent is due an interval from now.
                if wake:
                    keeper._wake.set()


class LeaseKeeper:
    """Extends held leases every `fraction` of their TTL until released, lost or dropped.

    Leases are held by weak reference: a lease its caller dropped is not kept alive.
    One scheduler thread decides what is due and marks leases lost at their deadline;
    each backend's extensions run on a thread of their own, so a hung server never
    delays another server's leases past their deadlines. A lease is lost only when the
    server refuses its extension (another owner, or the key is gone) or its deadline
    passes: a transient error (timeout, connection refused) is retried while the
    deadline leaves room. Loss fires the lease's callbacks and `on_lost`, and
    `lease.check()` raises from then on.
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
        # After fork the parent's threads are gone and its leases are not the child's to keep.
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._due: weakref.WeakKeyDictionary[Lease, float] = weakref.WeakKeyDictionary()
        self._lanes: dict[int, _Lane] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf  # when the thread will next wake by itself (inf: awake)
        self._watches: dict[int, Stoppable | None] = {}  # per backend (watch_evictions)

    # -- public ----------------------------------------------------------------
    def start(self) -> None:
        """Start the thread now (it also starts on the first `keep`); idempotent."""
        with self._mutex:
            self._start_locked()

    def keep(self, lease: Lease, *, watch: bool = False) -> None:
        """Start extending `lease` every fraction of its TTL. `watch`: the lease may be
        evicted (supersede); where its backend announces evictions, it is looked at once."""
        if self.on_lost is not None:
            lease.on_lost(self.on_lost)
        with self._mutex:
            due = first_due(self.clock.monotonic(), lease, self.fraction)
            self._due[lease] = due
            self._start_locked()
            # Wake the thread only if it would sleep past this lease's first extension: a
            # wake-up for every job is a thread switch on the hot path, for nothing.
            wake = due < self._wake_at
        if wake:
            self._wake.set()
        if watch and id(lease.backend) not in self._watches:
            self._watch(lease.backend)

    def _watch(self, backend: LockBackend) -> None:
        with self._mutex:
            if id(backend) in self._watches:
                return
            self._watches[id(backend)] = None  # one watcher a backend, whoever asks first
        watcher = backend.watch_evictions(self._evicted)
        with self._mutex:
            self._watches[id(backend)] = watcher

    def _evicted(self, key: str, fence: int) -> None:
        """An eviction notice: a lease of ours under `key` and `fence` is extended now, and
        the refusal marks it lost (the notice is a hint; only the server says lost)."""
        with self._mutex:
            now, hit = self.clock.monotonic(), False
            for lease, due in _snapshot(self._due):
                if lease.key == key and lease.fence == fence and due != math.inf:
                    self._due[lease], hit = now, True
        if hit:
            self._wake.set()

    def _start_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._wake_at = math.inf  # a new thread ticks at once
            self._lanes = {}  # lanes of a stopped keeper have ended (or are ending)
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
        with self._mutex:
            lanes = list(self._lanes.values())
            watches, self._watches = list(self._watches.values()), {}
        for watch in watches:
            if watch is not None:
                watch.stop(timeout)
        for lane in lanes:
            lane.wake()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        for lane in lanes:
            if lane.thread is not threading.current_thread():
                lane.thread.join(timeout)
        self._thread = None

    # -- the threads --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self._schedule()
            except Exception:  # never die silently: log, and keep keeping
                log.exception("lease keeper tick failed")
                wait = 0.05
            with self._mutex:  # `keep` wakes us if something falls due before this
                self._wake_at = self.clock.monotonic() + wait
            self._wake.wait(wait)
            with self._mutex:  # awake: the next tick sees whatever `keep` adds now
                self._wake_at = math.inf
            self._wake.clear()

    def _schedule(self) -> float:
        """The scheduler's tick: hand each backend's due leases to that backend's lane."""
        with self._mutex:
            busy = {bid for bid, lane in self._lanes.items() if lane.busy}
            for bid in busy:
                self._lanes[bid].skipped = True
            now = self.clock.monotonic()
            batches, wait = self._collect(now, busy)
            for bid, (backend, leases) in batches.items():
                lane = self._lanes.get(bid)
                if lane is None or not lane.thread.is_alive():
                    lane = self._lanes[bid] = _Lane(self, f"{self.name}:{backend.name}")
                lane.submit(backend, leases, now)
        return wait

    def tick(self) -> float:
        """Extend what is due in the calling thread; return seconds until the next thing is due.

        For callers (and tests) that drive a stopped keeper themselves.
        """
        with self._mutex:
            now = self.clock.monotonic()
            batches, wait = self._collect(now, set())
        for backend, leases in batches.values():
            self._extend_batch(backend, leases, now)
        if batches:  # what was just sent has a new due time (a retry comes sooner)
            with self._mutex:
                now = self.clock.monotonic()
                wait = min([wait, *(due - now for due in self._due.values())])
        return max(0.001, wait)

    def _collect(
        self, now: float, busy: set[int]
    ) -> tuple[dict[int, tuple[LockBackend, list[Lease]]], float]:
        """Due leases per backend (skipping busy backends); mark leases past their deadline.

        A backend with a lease due takes along every lease of its own that would fall due
        before that backend's next batch (one shortest interval away): after one batch the
        leases of a backend share one phase, so however many it holds and whenever they were
        taken, they cost one round trip per interval. A lease taken after a batch is due after
        the next one, and rides along with it, extended early rather than in a batch of its own.
        """
        held: dict[int, tuple[LockBackend, list[tuple[Lease, float]]]] = {}
        next_wake = MAX_SLEEP
        for lease, due in _snapshot(self._due):
            left = time_left(lease, now)
            if left <= 0 or lease.settled:
                if left <= 0 and not lease.released:
                    lease.mark_lost(deadline_loss(lease))
                del self._due[lease]
                continue
            # Wake at the deadline at the latest, to declare the loss on time even while
            # this lease's backend hangs in an extension.
            if left < next_wake:
                next_wake = left
            bid = id(lease.backend)
            if bid in busy:
                continue  # its lane wakes us when the call in flight returns
            if due == math.inf:  # sent to a lane that stopped before its call: due now
                due = now
            entry = held.get(bid)
            if entry is None:
                entry = held[bid] = (lease.backend, [])
            entry[1].append((lease, due))
        batches: dict[int, tuple[LockBackend, list[Lease]]] = {}
        for bid, (backend, leases) in held.items():
            batch, wait = pick_batch(leases, now, self.fraction)
            if not batch:  # nothing of this backend due yet
                next_wake = min(next_wake, wait)
                continue
            for lease in batch:
                self._due[lease] = math.inf  # in flight: _extend_batch sets the next due
            batches[bid] = (backend, batch)
        return batches, max(0.001, next_wake)

    def _extend_batch(self, backend: LockBackend, leases: list[Lease], chosen: float) -> bool:
        """Extend one backend's batch, chosen at `chosen`; False if the call failed.

        The next due time counts from when the batch was chosen, so the scan and the hand-
        over to the lane do not add to every interval; the new deadline counts from when the
        call was sent (what the server's TTL runs from, at the latest).
        """
        started = self.clock.monotonic()
        try:
            backend.extend_many(leases)  # marks the leases it refused lost itself
        except Exception as exc:
            # Unknown outcome, not a refusal: the lease may well still be ours. Try again
            # soon; only the deadline (or a refusal) makes it lost.
            OUTAGE.warning(
                log,
                "lease extension failed on %s for %d lease(s), retrying: %s",
                backend.name,
                len(leases),
                type(exc).__name__,
            )
            now = self.clock.monotonic()
            self._set_due(leases, lambda le: retry_due(now, le, self.fraction))
            return False
        self._set_due(leases, lambda le: next_due(chosen, le, self.fraction))
        if self.on_extend is not None:
            self.on_extend(backend.name, self.clock.monotonic() - started, len(leases))
        return True

    def _set_due(self, leases: list[Lease], when: Callable[[Lease], float]) -> None:
        earliest = math.inf
        with self._mutex:
            for lease in leases:
                if lease in self._due:  # not dropped meanwhile
                    due = self._due[lease] = when(lease)
                    if due < earliest:
                        earliest = due
            # The scheduler counted these leases as in flight when it chose its sleep: wake
            # it if one now falls due before it would wake by itself.
            wake = earliest < self._wake_at
        if wake:
            self._wake.set()
