"""The LockBackend base: validation and Lease bookkeeping once, one round trip per backend call."""

from __future__ import annotations

import math
import os
import random
import re
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from jobfence.config.findings import Finding, LockTarget, OutageProbe
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.decisions import DecisionBounds, DecisionLog
from jobfence.locks.errors import (
    LockError,
    NotOwner,
    RateLimitUnsupported,
    SemaphoreUnsupported,
)
from jobfence.locks.lease import Lease, OwnerMeta, new_owner_token
from jobfence.locks.ops import (
    Acquire,
    Begin,
    ClaimPublish,
    ClearPublish,
    Commit,
    CountDelivery,
    Extend,
    Inspect,
    LeaveSlot,
    ReadRecord,
    Release,
    ReleaseOwner,
    StoreOp,
    SwapPublish,
    TakeRate,
    TakeSlot,
    WaitRelease,
)
from jobfence.locks.procinfo import process_start
from jobfence.locks.registry import Capabilities as Capabilities
from jobfence.locks.registry import backends_with
from jobfence.locks.slots import (
    SlotInfo,
    SlotLease,
    SlotWait,
    validate_limit,
)

MAX_KEY_LENGTH = 512


@dataclass(frozen=True)
class Health:
    """One cheap round trip to the lock server: did it answer, how fast, and what it said
    (or why it failed). Never an owner token or a password."""

    ok: bool
    latency: float  # seconds, on this host's clock
    detail: str


@dataclass(frozen=True)
class Security:
    """How the connection to the lock server is protected, as configured (nothing is
    probed): for the start-up check, which warns about a downgrade or a remote server
    reached without authentication. `LockBackend.security()` gives None where unknown."""

    tls: bool  # every connection is encrypted (never a silent fall-back to plain text)
    verified: bool  # the server's certificate chain is checked against a CA
    hostname_checked: bool  # ... and must name the host connected to
    auth: bool  # the client proves who it is: a password, a client certificate, a digest


@dataclass(frozen=True)
class LockInfo:
    """What `inspect` reports of a held lock. The owner token is never included."""

    key: str
    fence: int
    ttl_left: float
    host: str
    pid: int
    task_id: str
    task_name: str
    acquired_at: float  # server wall clock, seconds since the epoch
    last_heartbeat: float  # server wall clock, seconds since the epoch
    process_start: str = ""  # the holder's boot id and start time (locks.procinfo), if known


@dataclass(frozen=True)
class Busy:
    """The key is held by someone else; it expires in `ttl_left` seconds at the latest."""

    ttl_left: float
    task_id: str = ""  # the holder's task id, so a task can tell its own earlier attempt
    fingerprint: str = ""  # the holder's argument fingerprint (job grants), to spot a conflict


@dataclass(frozen=True)
class JobRecord:
    """A job's completion record: state DONE or FAILED, with result and argument fingerprint."""

    state: str
    fingerprint: str
    result: str  # JSON text
    fence: int
    finished_at: float


BeginResult = Lease | Busy | JobRecord


class CommitRecord(NamedTuple):
    """What a commit writes: the job's record, under the lease's owner check (a backend's
    `_commit` unpacks it; the result TTL in milliseconds)."""

    key: str
    owner: str
    fence: int
    state: str  # DONE or FAILED
    result: str  # JSON text
    fingerprint: str
    result_ttl_ms: int


class RateGrant(NamedTuple):
    """One answer of `take_rate`. `admitted`: the event may happen `wait` seconds from now
    (0: at once; a slot was reserved for it). Refused: `wait` is how long until one would
    be admitted at once; nothing was reserved. `now`: the server clock, in seconds."""

    admitted: bool
    wait: float
    now: float


_process_meta: OwnerMeta | None = None  # this process's host and pid, built on first use


def _forget_process_meta() -> None:
    global _process_meta
    _process_meta = None


os.register_at_fork(after_in_child=_forget_process_meta)  # a forked child has its own pid


def default_meta(task_id: str = "", task_name: str = "") -> OwnerMeta:
    """This host and process (cached per process), with the given task id and name.

    The process's start time goes with its pid, so the orphan finder can tell this
    process from a later one that reused the pid.
    """
    global _process_meta
    meta = _process_meta
    if meta is None:
        pid = os.getpid()
        meta = _process_meta = OwnerMeta(
            host=socket.gethostname(), pid=pid, process_start=process_start(pid)
        )
    if not task_id and not task_name:
        return meta
    # Built directly: dataclasses.replace costs twice as much, once per job.
    return OwnerMeta(
        host=meta.host,
        pid=meta.pid,
        task_id=task_id,
        task_name=task_name,
        process_start=meta.process_start,
    )


_BAD_KEY_CHARS = re.compile(r"[{}*?\[\]\n]")


def validate_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise LockError(f"lock key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise LockError(f"lock key longer than {MAX_KEY_LENGTH} characters; hash it first")
    if _BAD_KEY_CHARS.search(key):
        raise LockError(f"lock key {key!r} contains one of '{{}}*?[]' or a newline; hash it first")


def validate_seconds(
    value: object, name: str, *, positive: bool = False, forever: bool = False
) -> float:
    """`value` as seconds: a number, >= 0 (> 0 if `positive`) and finite (+inf too if
    `forever`, "wait for ever"); else LockError naming `name`. NaN passes every `<` test."""
    sign = "positive" if positive else "non-negative"
    if not isinstance(value, int | float):
        raise LockError(f"{name} must be a {sign} number of seconds, got {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or (math.isinf(seconds) and not (forever and seconds > 0)):
        fix = "pass None to wait for ever" if forever else "pass a number of seconds, e.g. 30"
        raise LockError(f"{name} must be a finite number of seconds, got {value!r}; {fix}")
    if seconds < 0 or (positive and seconds == 0):
        raise LockError(f"{name} must be a {sign} number of seconds, got {value!r}")
    return seconds


def validate_ttl(ttl: float) -> int:
    """Return the TTL in whole milliseconds, refusing anything below 1 ms (and NaN, infinity)."""
    validate_seconds(ttl, "ttl", positive=True)
    ms = int(ttl * 1000)
    if ms < 1:
        raise LockError(f"ttl must be at least 0.001 seconds, got {ttl!r}")
    return ms


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


def grant_args(key: str, ttl: float, meta: OwnerMeta | None) -> tuple[int, OwnerMeta]:
    """Refuse a bad key or TTL of a grant; (TTL in ms, the holder's meta or this process's)."""
    validate_key(key)
    return validate_ttl(ttl), meta or default_meta()


def check_swap(key: str, expect: str, new: str | None, ttl: float) -> int:
    """Refuse a bad swap_publish (see LockBackend.swap_publish); its TTL in ms."""
    validate_key(key)
    if not expect or new == "":
        raise LockError("swap_publish needs a non-empty expect, and new non-empty or None",
                        key=key)  # fmt: skip
    return validate_ttl(ttl)


def commit_record(
    lease: Lease, state: str, result: str, fingerprint: str, result_ttl: float
) -> CommitRecord:
    """Refuse a bad commit (a state not DONE or FAILED, a bad result TTL); what it writes."""
    if state not in ("DONE", "FAILED"):
        raise LockError(f"commit state must be DONE or FAILED, got {state!r}", key=lease.key)
    return CommitRecord(lease.key, lease.owner, lease.fence, state, result, fingerprint,
                        validate_ttl(result_ttl))  # fmt: skip


def validate_rate(key: str, interval: float, burst: int) -> None:
    if not interval > 0 or not isinstance(burst, int) or burst < 1:
        raise LockError(
            f"rate needs interval > 0 and burst >= 1, got {interval!r}, {burst!r}", key=key
        )


class LockBackend(ABC):
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
            case TakeSlot(key, limit, ttl, owner, meta, queue_ttl):
                return self.semaphore_attempt(
                    key, limit, ttl, owner=owner, meta=meta, queue_ttl=queue_ttl
                )
            case LeaveSlot(key, owner):
                return self.semaphore_leave(key, owner)
            case TakeRate(key, interval, burst, max_wait):
                return self.take_rate(key, interval, burst, max_wait)
            case Inspect(key):
                return self.inspect(key)
            case ClaimPublish(key, task_id, ttl):
                return self.claim_publish(key, task_id, ttl)
            case SwapPublish(key, expect, new, ttl):
                return self.swap_publish(key, expect, new, ttl)
            case ClearPublish(key):
                self.clear_publish(key)
                return None
            case ReadRecord(key):
                return self.job_record(key)
            case CountDelivery(key, window):
                return self.count_delivery(key, window)
        raise LockError(f"the {self.name} lock backend cannot run {type(op).__name__}")

    # -- semaphores: validate, then one call ----------------------------------------
    def semaphore_attempt(
        self,
        key: str,
        limit: int,
        ttl: float,
        *,
        owner: str | None = None,
        meta: OwnerMeta | None = None,
        queue_ttl: float = 0.0,
    ) -> SlotLease | SlotWait:
        """Take a slot of semaphore `key` if fewer than `limit` are held and no earlier
        waiter is owed it; else say how many wait ahead.

        With `queue_ttl` > 0 a refused `owner` takes (or keeps) its place in the arrival
        queue for `queue_ttl` seconds; poll again with the same owner to keep it. With 0
        the attempt is a plain try that never jumps the queue: it takes a slot only if one
        is free beyond those owed to waiters.
        """
        self.require_semaphore()
        validate_key(key)
        validate_limit(limit, key)
        ttl_ms = validate_ttl(ttl)
        queue_ms = validate_ttl(queue_ttl) if queue_ttl > 0 else 0
        owner = owner or new_owner_token()
        meta = meta or default_meta()
        started = self.clock.monotonic()
        got = self._sem_acquire(key, owner, limit, ttl_ms, queue_ms, meta)
        if isinstance(got, SlotWait):
            return got
        return SlotLease.granted(self, key, owner, got, ttl_ms, started, meta, limit=limit)

    def semaphore_leave(self, key: str, owner: str) -> bool:
        """Give up `owner`'s place in the queue of `key`, or its slot if it got one."""
        self.require_semaphore()
        validate_key(key)
        return self._sem_release(key, owner)

    def semaphore_holders(self, key: str) -> list[SlotInfo]:
        """The live slots of semaphore `key`, oldest fence first."""
        self.require_semaphore()
        validate_key(key)
        return sorted(self._sem_holders(key), key=lambda s: s.fence)

    def require_semaphore(self) -> None:
        """Raise SemaphoreUnsupported unless this backend keeps semaphores."""
        if not self.capabilities.semaphore:
            raise SemaphoreUnsupported(
                f"the {self.name} lock backend keeps no semaphores (concurrency limits); "
                f"use one that does: {backends_with('semaphore', fleet=False)}"
            )

    def _sem_acquire(
        self, key: str, owner: str, limit: int, ttl_ms: int, queue_ms: int, meta: OwnerMeta
    ) -> int | SlotWait:
        """The new slot's fence, or SlotWait. One atomic step on the server."""
        raise SemaphoreUnsupported(f"{self.name} keeps no semaphores")

    def _sem_extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        raise SemaphoreUnsupported(f"{self.name} keeps no semaphores")

    def _sem_release(self, key: str, owner: str) -> bool:
        """Free `owner`'s slot and drop it from the queue; True if a live slot was freed."""
        raise SemaphoreUnsupported(f"{self.name} keeps no semaphores")

    def _sem_holders(self, key: str) -> list[SlotInfo]:
        raise SemaphoreUnsupported(f"{self.name} keeps no semaphores")

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

    def close(self) -> None:  # noqa: B027 - optional hook
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


class NativeAsyncStore(ABC):
    """What a native asyncio store (redis.asyncio, psycopg's async connection, Redlock's
    rounds on a loop) shares with LockBackend's begin and commit: the validation, the Lease
    of a grant (naming the sync twin `backend`, so `lease.release()` from a thread works)
    and the commit's bookkeeping. Each store awaits the one round trip itself (`_grant`,
    `_commit`), as a LockBackend makes it in `_begin` and `_commit`."""

    backend: LockBackend
    clock: Clock

    async def begin_op(self, op: Begin) -> BeginResult:
        return await self._begin(op.key, op.ttl, new_owner_token(), op.meta, op.record,
                                 op.fingerprint)  # fmt: skip

    async def commit_op(self, op: Commit) -> bool:
        ok = await self._commit(
            commit_record(op.lease, op.state, op.result, op.fingerprint, op.result_ttl)
        )
        op.lease._released = True
        return ok

    async def _begin(
        self, key: str, ttl: float, owner: str, meta: OwnerMeta | None, record: bool,
        fingerprint: str,
    ) -> BeginResult:  # fmt: skip
        """As LockBackend.begin (an Acquire is a begin without a record)."""
        ttl_ms, meta = grant_args(key, ttl, meta)
        started = self.clock.monotonic()
        got = await self._grant(key, owner, ttl_ms, meta, record, fingerprint)
        if isinstance(got, int):
            return self.backend.lease(key, owner, got, ttl_ms, started, meta)
        return got

    @abstractmethod
    async def _grant(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        """One round trip: the new fence on a grant, Busy, or the job record if DONE."""

    @abstractmethod
    async def _commit(self, rec: CommitRecord) -> bool:
        """One round trip: store `rec` and release, if `rec.owner` still holds the lock."""


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
