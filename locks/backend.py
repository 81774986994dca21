"""The LockBackend base: validation and Lease bookkeeping once, one round trip per backend call."""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

from jobfence.config.findings import Finding, LockTarget, OutageProbe
from jobfence.locks.backend_ops import run_other_op
from jobfence.locks.backend_semaphores import BackendSemaphores
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.decisions import DecisionBounds, DecisionLog
from jobfence.locks.errors import NotOwner, RateLimitUnsupported
from jobfence.locks.lease import Lease, OwnerMeta, new_owner_token
from jobfence.locks.native_async import NativeAsyncStore as NativeAsyncStore
from jobfence.locks.ops import (
    Acquire,
    Begin,
    Commit,
    Extend,
    Release,
    ReleaseOwner,
    StoreOp,
    WaitRelease,
)
from jobfence.locks.registry import Capabilities as Capabilities
from jobfence.locks.registry import backends_with
from jobfence.locks.replies import BeginResult as BeginResult
from jobfence.locks.replies import Busy as Busy
from jobfence.locks.replies import CommitRecord as CommitRecord
from jobfence.locks.replies import Health as Health
from jobfence.locks.replies import JobRecord as JobRecord
from jobfence.locks.replies import LockInfo as LockInfo
from jobfence.locks.replies import RateGrant as RateGrant
from jobfence.locks.replies import Security as Security
from jobfence.locks.slots import SlotLease
from jobfence.locks.validation import MAX_KEY_LENGTH as MAX_KEY_LENGTH
from jobfence.locks.validation import check_swap as check_swap
from jobfence.locks.validation import commit_record as commit_record
from jobfence.locks.validation import default_meta as default_meta
from jobfence.locks.validation import grant_args as grant_args
from jobfence.locks.validation import validate_key as validate_key
from jobfence.locks.validation import validate_rate as validate_rate
from jobfence.locks.validation import validate_seconds as validate_seconds
from jobfence.locks.validation import validate_ttl as validate_ttl


def settle_extensions(leases: Sequence[Lease], results: list[bool], started: float) -> list[bool]:
    """After one batched extension sent at `started`: move each confirmed lease's deadline,
    mark each refused one lost. Every store's Extend ends here."""
    for lease, ok in zip(leases, results, strict=True):
        if ok:
            lease.renewed(started)
        else:
            lease.mark_lost(
                NotOwner("extend refused: not the owner", key=lease.key, fence=lease.fence)
            )
    return results


class Stoppable(Protocol):
    """A watcher a backend started (`watch_evictions`), stopped with its keeper."""

    def stop(self, timeout: float = 5.0) -> None: ...


class LockBackend(BackendSemaphores, ABC):
    """A lock server. Subclasses implement the `_`-prefixed one-round-trip methods."""

    capabilities: ClassVar[Capabilities]
    name: ClassVar[str]

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock

    # -- public API: validate, then one round trip ------------------------------
    def try_acquire(self, key: str, ttl: float, *, meta: OwnerMeta | None = None) -> Lease | None:
        """Acquire `key` for `ttl` seconds if free; None if someone else holds it."""
        got = self.attempt(key, ttl, meta=meta)
        return got if isinstance(got, Lease) else None

    def attempt(
        self, key: str, ttl: float, *, meta: OwnerMeta | None = None, owner: str | None = None
    ) -> Lease | Busy:
        """Like try_acquire, but says how long the current holder's lease has left."""
        got = self.begin(key, ttl, meta=meta, owner=owner)
        assert not isinstance(got, JobRecord)
        return got

    def begin(
        self,
        key: str,
        ttl: float,
        *,
        meta: OwnerMeta | None = None,
        record: bool = False,
        fingerprint: str = "",
        owner: str | None = None,
    ) -> BeginResult:
        """Acquire `key` unless its job record says DONE (then return the record).

        With `record=True` a FAILED record does not stop a new run (the grant clears it);
        while the job runs, the lock itself says who runs it. `fingerprint` is kept with
        the grant and returned in `Busy`, so the same key with other arguments is a
        conflict while the job runs, not only after DONE. `owner`: the token to hold it
        under (a flow picks it, so it can release a grant whose reply it never read).
        """
        ttl_ms, meta = grant_args(key, ttl, meta)
        owner = owner or new_owner_token()
        started = self.clock.monotonic()
        got = self._begin(key, owner, ttl_ms, meta, record, fingerprint)
        return self.lease(key, owner, got, ttl_ms, started, meta) if isinstance(got, int) else got

    def lease(
        self, key: str, owner: str, fence: int, ttl_ms: int, started: float, meta: OwnerMeta
    ) -> Lease:
        """The Lease of a grant asked for at `started` (this backend's clock), naming this
        backend (an asyncio store's grants too, so `lease.release()` works from a thread)."""
        lease = Lease.granted(self, key, owner, fence, ttl_ms, started, meta)
        self._on_grant(lease)
        return lease

    def _on_grant(self, lease: Lease) -> None:
        """Hook: a backend whose grant lives on a clock of its own (etcd's process lease)
        sets the new lease's deadline from it here; the default counts from the request."""
        del lease

    def extend(self, lease: Lease, ttl: float | None = None) -> None:
        """Push the lease's expiry to now + ttl. Raises NotOwner (and marks it lost) if not ours."""
        ttl_ms = validate_ttl(ttl if ttl is not None else lease.ttl)
        started = self.clock.monotonic()
        if type(lease) is SlotLease:
            ok = self._sem_extend_many([(lease.key, lease.owner, ttl_ms)])[0]
        else:
            ok = self._extend(lease.key, lease.owner, ttl_ms)
        if not ok:
            err = NotOwner("extend refused: not the owner", key=lease.key, fence=lease.fence)
            lease.mark_lost(err)
            raise err
        lease.renewed(started, ttl_ms / 1000)

    def extend_many(self, leases: Sequence[Lease]) -> list[bool]:
        """Extend every lease by its own TTL in one round trip; losers are marked lost."""
        if not leases:
            return []
        started = self.clock.monotonic()
        items = [(le.key, le.owner, validate_ttl(le.ttl)) for le in leases]
        return settle_extensions(leases, self._extend_leases_and_slots(leases, items), started)

    def _extend_leases_and_slots(
        self, leases: Sequence[Lease], items: list[tuple[str, str, int]]
    ) -> list[bool]:
        """`_extend_many` for lock leases, `_sem_extend_many` for slots (a round trip each)."""
        slots = [i for i, le in enumerate(leases) if type(le) is SlotLease]
        if not slots:
            return self._extend_many(items)
        locks = [i for i in range(len(items)) if type(leases[i]) is not SlotLease]
        results = [False] * len(items)
        if locks:
            for i, ok in zip(locks, self._extend_many([items[i] for i in locks]), strict=True):
                results[i] = ok
        for i, ok in zip(slots, self._sem_extend_many([items[i] for i in slots]), strict=True):
            results[i] = ok
        return results

    def release(self, lease: Lease) -> bool:
        """Owner-checked release; False if the lease had expired or belongs to another."""
        if type(lease) is SlotLease:
            return self._sem_release(lease.key, lease.owner)
        return self._release(lease.key, lease.owner)

    # -- the Store seam: one entry point per op (locks/ops.py), over the methods above --
    def execute(self, op: StoreOp) -> Any:
        """Run one op of a flow (locks/flows.py) as one round trip; its reply is the
        method's own (the table in locks/ops.py)."""
        match op:
            # A job's two round trips first, read by attribute: cheaper than captures.
            case Begin():
                return self.begin(op.key, op.ttl, meta=op.meta, record=op.record,
                                  fingerprint=op.fingerprint)  # fmt: skip
            case Commit():
                return self.commit(
                    op.lease, state=op.state, result=op.result, fingerprint=op.fingerprint,
                    result_ttl=op.result_ttl,
                )  # fmt: skip
            case Acquire(key, ttl, owner, meta):
                return self.attempt(key, ttl, meta=meta, owner=owner)
            case WaitRelease(key, timeout):
                self.wait_for_release(key, timeout)
                return None
            case Extend(leases):
                return self.extend_many(leases)
            case Release(lease):
                return lease.release()
            case ReleaseOwner(key, owner):
                validate_key(key)
                return self._release(key, owner)
        return run_other_op(self, op)

    def commit(
        self, lease: Lease, *, state: str, result: str, fingerprint: str, result_ttl: float
    ) -> bool:
        """Store the job record (DONE or FAILED) and release, atomically and owner-checked."""
        ok = self._commit(commit_record(lease, state, result, fingerprint, result_ttl))
        lease._released = True
        return ok

    def inspect(self, key: str) -> LockInfo | None:
        validate_key(key)
        return self._inspect(key)

    @abstractmethod
    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        """Held locks whose key matches the glob `match`; never blocks the server."""

    @abstractmethod
    def job_record(self, key: str) -> JobRecord | None:
        """The stored job record for `key`, if DONE or FAILED."""

    @abstractmethod
    def forget(self, key: str) -> bool:
        """Admin: delete the job record of `key` (the fence is kept)."""

    @abstractmethod
    def force_release(self, key: str) -> bool:
        """Admin: remove a lock whatever its owner (the fence counter is kept)."""

    @abstractmethod
    def release_grant(self, key: str, fence: int) -> bool:
        """Admin: remove `key`'s lock only if it is still held under `fence` (the grant an
        operator judged; fences are unique per grant, so the fence stands for the owner).

        The fence is checked in the removing operation itself (a script, a txn, a
        `DELETE ... WHERE fence`): a look, then a removal, would take a grant made between.
        """

    def watch_evictions(self, heard: Callable[[str, int], None]) -> Stoppable | None:
        """Start hearing `release_grant`s at once: `heard(key, fence)` on a thread of the
        backend's; None where the backend publishes none (its keepers find an evicted lease
        at the next extension)."""
        return None

    @abstractmethod
    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        """Record `task_id` as the queued job for `key`; return the id already there, if any."""

    @abstractmethod
    def clear_publish(self, key: str) -> None:
        """Forget the queued task id for `key`, so the next publish goes through."""

    def swap_publish(self, key: str, expect: str, new: str | None, ttl: float) -> str | None:
        """Compare-and-set the publish claim of `key`: None if it now holds `new`, else the
        value that kept it.

        Atomically: if the claim is free (absent or expired) or holds `expect` or `new`, it
        becomes `new` for `ttl` seconds (`new=None` removes it) and None is returned; any
        other value is left alone and returned. `swap_publish(k, t, t, ttl)` is
        `claim_publish` that refreshes the TTL; `swap_publish(k, t, None, ttl)` an
        owner-checked `clear_publish`; `swap_publish(k, old, new, ttl)` hands a queued
        job's claim to its replacement.
        """
        return self._swap_publish(key, expect, new, check_swap(key, expect, new, ttl))

    @abstractmethod
    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        """One round trip: the compare-and-set of `swap_publish`."""

    def wait_for_release(self, key: str, timeout: float) -> None:
        """Block up to `timeout` seconds or until `key` is released, whichever is first."""
        self.clock.sleep(timeout)

    def count_delivery(self, key: str, window: float) -> int | None:
        """Count one more crash-suspect delivery of `key`'s job; returns the count so far.

        The count is kept `window` seconds after its last increment. None: this backend
        keeps no such count (the executor then cannot cap a poison message's deliveries).
        Off the happy path: called only for a delivery that follows one that may have died.
        """
        validate_key(key)
        return self._count_delivery(key, validate_ttl(window))

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        return None

    def take_rate(self, key: str, interval: float, burst: int, max_wait: float) -> RateGrant:
        """One event on the GCRA limiter `key` (see locks/ratelimit.py), on the server's clock.

        Admitted if its turn comes within `max_wait` seconds: the turn is then reserved, and
        the caller must wait `wait` seconds before acting. A negative `max_wait` only looks.
        """
        validate_key(key)
        if not self.capabilities.rate_limit:
            raise RateLimitUnsupported(
                f"the {self.name} lock backend keeps no shared rate limits; use "
                f"{backends_with('rate_limit')}",
                key=key,
            )
        validate_rate(key, interval, burst)
        admitted, wait_us, now_us = self._take_rate(key, interval * 1e6, burst, max_wait * 1e6)
        return RateGrant(admitted, max(0.0, wait_us / 1e6), now_us / 1e6)

    def _take_rate(
        self, key: str, interval_us: float, burst: int, max_wait_us: float
    ) -> tuple[bool, float, float]:
        """(admitted, wait µs, server now µs) in one round trip; backends with the
        `rate_limit` capability override it."""
        raise RateLimitUnsupported(f"the {self.name} lock backend keeps no rate limits", key=key)

    def server_time(self) -> float:
        """Now, in Unix seconds, on the clock the server stamps heartbeats with; this
        default is the local clock (a backend with a server clock overrides it)."""
        return time.time()

    def health(self) -> Health:
        """Ask the server one cheap question (never raises): for `jobfence check` and probes."""
        started = time.perf_counter()
        try:
            detail = self._ping()
        except Exception as exc:  # a probe reports the failure; it is not the caller's to handle
            return Health(False, time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
        return Health(True, time.perf_counter() - started, detail)

    def _ping(self) -> str:
        """One round trip; what the server answered, in a few words. This default reads
        the server's clock: backends whose `server_time` is local override it."""
        return f"server time {self.server_time():.6f}"

    def security(self) -> Security | None:
        """TLS and authentication as configured, for the start-up check; None: unknown
        (a backend that can say overrides it)."""
        return None

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        """What a worker's start-up finds about this lock server (reachable as the URL says,
        with credentials that work, unable to lose a lease): refusals and warnings, checked
        by `jobfence.worker.checks`. This default finds nothing (a backend that can say
        overrides it)."""
        return iter(())

    def outage_probe(self, target: LockTarget) -> OutageProbe | None:
        """A probe of a lock server the start-up found down (a LOCK_SERVER_DOWN finding),
        which the worker polls until it answers and then logs its findings; None: none."""
        return None

    def decision_log(self, bounds: DecisionBounds) -> DecisionLog | None:
        """Where this store keeps the decision log (locks/decisions.py); None: it keeps
        none (the structured log line per decision is all there is)."""
        return None

    def close(self) -> None:
        """Free connections."""

    # -- one round trip each ----------------------------------------------------
    @abstractmethod
    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        """Return the new fence on a grant, Busy, or the job record if DONE."""

    @abstractmethod
    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool: ...

    @abstractmethod
    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]: ...

    @abstractmethod
    def _release(self, key: str, owner: str) -> bool: ...

    @abstractmethod
    def _commit(self, rec: CommitRecord) -> bool:
        """Store `rec` and release the lock, atomically, if `rec.owner` still holds it."""

    @abstractmethod
    def _inspect(self, key: str) -> LockInfo | None: ...



def poll_until_free(
    clock: Clock, timeout: float, held: Callable[[], bool], first: float, cap: float
) -> None:
    """Sleep, then ask `held()`, with doubling, jittered steps from `first` up to `cap`,
    until it says free or `timeout` passes: the wait of a backend with no notification a
    waiter could block on (MySQL; PostgreSQL behind a pooler, where LISTEN is session state).
    The refused attempt just before it read the lock: it sleeps first."""
    deadline = clock.monotonic() + timeout
    step = first
    while True:
        left = deadline - clock.monotonic()
        if left <= 0:
            return
        clock.sleep(min(left, random.uniform(step / 2, step)))
        step = min(step * 2, cap)
        if not held():
            return
