"""An in-process backend for unit tests of pure logic; same semantics as Redis, one process only."""

from __future__ import annotations

import fnmatch
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    LockBackend,
    LockInfo,
    validate_key,
)
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.decisions import DecisionBounds, DecisionLog, RingDecisionLog
from jobfence.locks.lease import OwnerMeta
from jobfence.locks.ratelimit import gcra
from jobfence.locks.slots import SlotInfo, SlotWait


@dataclass
class _Held:
    owner: str
    fence: int
    expires: float
    meta: OwnerMeta
    acquired: float
    heartbeat: float
    fingerprint: str = ""


class MemoryBackend(LockBackend):
    """Locks in a dict guarded by a condition variable; expiry follows the injected clock."""

    name: ClassVar[str] = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=False, ha=False, release_notify=True,
        semaphore=True, rate_limit=True,
    )

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(clock=clock)
        self._held: dict[str, _Held] = {}
        self._fences: dict[str, int] = {}
        self._records: dict[str, tuple[JobRecord, float]] = {}
        self._queued: dict[str, tuple[str, float]] = {}
        self._deliveries: dict[str, tuple[int, float]] = {}  # key -> (count, expires)
        self._rates: dict[str, float] = {}  # rate limiter key -> tat, µs on the clock
        self._cond = threading.Condition()
        # Semaphores: key -> owner -> (fence, expires, meta); key -> owner -> waiter expiry
        # (dicts keep insertion order: the arrival queue); key -> last slot fence.
        self._slots: dict[str, dict[str, tuple[int, float, OwnerMeta]]] = {}
        self._waiters: dict[str, dict[str, float]] = {}
        self._slot_fences: dict[str, int] = {}
        self._decisions: RingDecisionLog | None = None
        # A forked child has its own copy of the dicts; a thread of the parent inside one of
        # our methods at the fork would leave the copied condition held for ever.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (b := ref()) and b._forked())  # type: ignore[func-returns-value]

    def _forked(self) -> None:
        self._cond = threading.Condition()

    @classmethod
    def from_url(cls, url: str, *, clock: Clock = SYSTEM_CLOCK, **options: Any) -> MemoryBackend:
        """`memory://`: one process's locks. The options other backends take (prefix,
        socket_timeout) mean nothing here and are ignored, so one settings object fits all."""
        return cls(clock=clock)

    def decision_log(self, bounds: DecisionBounds) -> DecisionLog | None:
        """One ring per backend (the first caller's bounds): in this process only, like
        the locks."""
        with self._cond:
            if self._decisions is None:
                self._decisions = RingDecisionLog(bounds)
            return self._decisions

    def _ping(self) -> str:
        return "in process"

    def _live(self, key: str) -> _Held | None:
        h = self._held.get(key)
        if h is not None and h.expires <= self.clock.monotonic():
            del self._held[key]
            return None
        return h

    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        # Every job's first step: the condition's lock taken by its own C methods (`with`
        # adds the Condition's Python layer), the holder looked at with the one clock read.
        cond = self._cond
        cond.acquire()
        try:
            now = self.clock.monotonic()
            if record:
                rec = self._records.get(key)
                if rec and rec[1] > now and rec[0].state == "DONE":
                    return rec[0]
            h = self._held.get(key)
            if h is not None:
                if h.expires > now:
                    return Busy(
                        ttl_left=h.expires - now, task_id=h.meta.task_id, fingerprint=h.fingerprint
                    )
                del self._held[key]  # expired
            fence = self._fences.get(key, 0) + 1
            self._fences[key] = fence
            at = time.time()
            self._held[key] = _Held(owner, fence, now + ttl_ms / 1000, meta, at, at, fingerprint)
            return fence
        finally:
            cond.release()

    def _take_rate(
        self, key: str, interval_us: float, burst: int, max_wait_us: float
    ) -> tuple[bool, float, float]:
        with self._cond:
            now = self.clock.monotonic() * 1e6  # the injected clock is this server's clock
            admitted, wait, tat = gcra(
                self._rates.get(key, 0.0), now, interval_us, burst, max_wait_us
            )
            self._rates[key] = tat
            return admitted, wait, now

    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        with self._cond:
            h = self._live(key)
            if h is None or h.owner != owner:
                return False
            h.expires = self.clock.monotonic() + ttl_ms / 1000
            h.heartbeat = time.time()
            return True

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        return [self._extend(k, o, t) for k, o, t in items]

    def _release(self, key: str, owner: str) -> bool:
        return self._drop(key, lambda h: h.owner == owner)

    def _drop(self, key: str, match: Callable[[_Held], bool]) -> bool:
        """Release `key` if its live holder matches; wake the waiters."""
        with self._cond:
            h = self._live(key)
            if h is None or not match(h):
                return False
            del self._held[key]
            self._cond.notify_all()
            return True

    def _commit(self, rec: CommitRecord) -> bool:
        key, owner, fence, state, result, fingerprint, result_ttl_ms = rec
        cond = self._cond
        cond.acquire()  # as in _begin: the lock's C methods, one clock read
        try:
            now = self.clock.monotonic()
            h = self._held.get(key)
            if h is not None and h.expires <= now:
                del self._held[key]  # expired
                h = None
            if h is None or h.owner != owner:
                return False
            record = JobRecord(state, fingerprint, result, fence, time.time())
            self._records[key] = (record, now + result_ttl_ms / 1000)
            del self._held[key]
            cond.notify_all()
            return True
        finally:
            cond.release()

    def _inspect(self, key: str) -> LockInfo | None:
        with self._cond:
            h = self._live(key)
            if h is None:
                return None
            return LockInfo(
                key=key,
                fence=h.fence,
                ttl_left=h.expires - self.clock.monotonic(),
                host=h.meta.host,
                pid=h.meta.pid,
                task_id=h.meta.task_id,
                task_name=h.meta.task_name,
                acquired_at=h.acquired,
                last_heartbeat=h.heartbeat,
                process_start=h.meta.process_start,
            )

    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        with self._cond:
            keys = [k for k in self._held if fnmatch.fnmatchcase(k, match)]
        for k in keys:
            info = self._inspect(k)
            if info is not None:
                yield info

    def job_record(self, key: str) -> JobRecord | None:
        with self._cond:
            rec = self._records.get(key)
            if rec is None or rec[1] <= self.clock.monotonic():
                return None
            return rec[0]

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        with self._cond:
            now = self.clock.monotonic()
            held = self._queued.get(key)
            if held and held[1] > now and held[0] != task_id:
                return held[0]
            self._queued[key] = (task_id, now + ttl)
            return None

    def clear_publish(self, key: str) -> None:
        with self._cond:
            self._queued.pop(key, None)

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        with self._cond:
            now = self.clock.monotonic()
            held = self._queued.get(key)
            found = held[0] if held and held[1] > now else None
            if found is not None and found not in (expect, new):
                return found
            if new is None:
                self._queued.pop(key, None)
            else:
                self._queued[key] = (new, now + ttl_ms / 1000)
            return None

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        with self._cond:
            now = self.clock.monotonic()
            count, expires = self._deliveries.get(key, (0, now))
            count = count + 1 if expires > now else 1
            self._deliveries[key] = (count, now + window_ms / 1000)
            return count

    def forget(self, key: str) -> bool:
        with self._cond:
            return self._records.pop(key, None) is not None

    def force_release(self, key: str) -> bool:
        with self._cond:
            gone = self._held.pop(key, None) is not None
            self._cond.notify_all()
            return gone

    def release_grant(self, key: str, fence: int) -> bool:
        validate_key(key)
        return self._drop(key, lambda h: h.fence == fence)

    def wait_for_release(self, key: str, timeout: float) -> None:
        if self.clock is not SYSTEM_CLOCK:
            self.clock.sleep(timeout)
            return
        with self._cond:
            if self._live(key) is None:  # released before we got here: don't miss its wake-up
                return
            self._cond.wait(timeout)

    # -- semaphores -------------------------------------------------------------------
    def _live_slots(self, key: str, now: float) -> dict[str, tuple[int, float, OwnerMeta]]:
        slots = self._slots.setdefault(key, {})
        for owner in [o for o, (_, exp, _) in slots.items() if exp <= now]:
            del slots[owner]
        waiters = self._waiters.setdefault(key, {})
        for owner in [o for o, exp in waiters.items() if exp <= now]:
            del waiters[owner]
        return slots

    def _sem_acquire(
        self, key: str, owner: str, limit: int, ttl_ms: int, queue_ms: int, meta: OwnerMeta
    ) -> int | SlotWait:
        with self._cond:
            now = self.clock.monotonic()
            slots = self._live_slots(key, now)
            if owner in slots:  # a repeat of a call whose answer was lost
                return slots[owner][0]
            waiters = self._waiters[key]
            free = limit - len(slots)
            ahead = list(waiters).index(owner) if owner in waiters else len(waiters)
            if ahead < free:
                waiters.pop(owner, None)
                fence = self._slot_fences.get(key, 0) + 1
                self._slot_fences[key] = fence
                slots[owner] = (fence, now + ttl_ms / 1000, meta)
                return fence
            if queue_ms:
                waiters[owner] = now + queue_ms / 1000
            else:
                ahead = -1
            first = min((exp for _, exp, _ in slots.values()), default=now)
            return SlotWait(position=ahead, ttl_left=max(0.0, first - now))

    def _sem_extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        out = []
        with self._cond:
            now = self.clock.monotonic()
            for key, owner, ttl_ms in items:
                slots = self._live_slots(key, now)
                held = slots.get(owner)
                if held is not None:
                    slots[owner] = (held[0], now + ttl_ms / 1000, held[2])
                out.append(held is not None)
        return out

    def _sem_release(self, key: str, owner: str) -> bool:
        with self._cond:
            slots = self._live_slots(key, self.clock.monotonic())
            self._waiters[key].pop(owner, None)
            return slots.pop(owner, None) is not None

    def _sem_holders(self, key: str) -> list[SlotInfo]:
        with self._cond:
            now = self.clock.monotonic()
            return [
                SlotInfo(fence, exp - now, m.host, m.pid, m.task_id, m.task_name)
                for fence, exp, m in self._live_slots(key, now).values()
            ]
