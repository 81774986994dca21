"""The plain-Python lock API for code outside Celery: a context manager and a decorator."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import jobfence.locks.registry as registry
from jobfence.locks.backend import LockBackend, default_meta, validate_seconds
from jobfence.locks.drive import run_sync
from jobfence.locks.errors import AcquireTimeout, LeaseLost
from jobfence.locks.flows import Backoff, acquire_flow
from jobfence.locks.keeper import LeaseKeeper
from jobfence.locks.leader import (
    LeaderElector,
    LeadershipObserver,
    Term,
    TermCallback,
    elect,
    leader_key,
    try_elect,
)
from jobfence.locks.lease import Lease
from jobfence.locks.ratelimit import Rate, RateLimiter
from jobfence.locks.semaphore import acquire_slot
from jobfence.locks.slots import SlotLease

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


class Locker:
    """Binds a backend and a LeaseKeeper; hands out kept leases.

    with locker.lock("inventory:42", ttl=10) as lease:
        write_stock(..., fence=lease.fence)
    """

    def __init__(
        self,
        backend: LockBackend,
        *,
        keeper: LeaseKeeper | None = None,
        ttl: float = 30.0,
        timeout: float = 10.0,
        backoff: Backoff | None = None,
        on_leadership: LeadershipObserver | None = None,
    ) -> None:
        self.backend = backend
        self.on_leadership = on_leadership
        self.keeper = keeper or LeaseKeeper(clock=backend.clock)
        self.ttl = validate_seconds(ttl, "Locker ttl", positive=True)
        self.timeout = validate_seconds(timeout, "Locker timeout")
        self.backoff = backoff or Backoff()

    @classmethod
    def from_url(cls, url: str, *, ttl: float = 30.0, timeout: float = 10.0,
                 **options: Any) -> Locker:  # fmt: skip
        """A Locker on any lock URL jobfence accepts (`options` go to `open_backend`)."""
        return cls(open_backend(url, **options), ttl=ttl, timeout=timeout)

    def acquire(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        blocking: bool = True,
    ) -> Lease:
        """Acquire and start keeping `key`. Release with `release(lease)`."""
        ttl = self.ttl if ttl is None else ttl
        flow = acquire_flow(
            key,
            ttl=ttl,
            timeout=(self.timeout if timeout is None else timeout) if blocking else 0.0,
            backoff=self.backoff,
            meta=default_meta(),
            blocking=blocking,
        )
        lease = run_sync(flow, self.backend, self.backend.clock)
        self.keeper.keep(lease)
        return lease

    def release(self, lease: Lease) -> bool:
        self.keeper.drop(lease)
        return lease.release()

    @contextmanager
    def lock(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        blocking: bool = True,
    ) -> Iterator[Lease]:
        """Hold `key` for the block. Raises LeaseLost at exit if the lease was lost meanwhile."""
        lease = self.acquire(key, ttl=ttl, timeout=timeout, blocking=blocking)
        ok = False
        try:
            yield lease
            ok = True
        finally:
            lost = lease.lost
            self.release(lease)
        if ok and lost:
            raise LeaseLost("lease lost while the block ran", key=key, fence=lease.fence)

    def acquire_slot(
        self,
        key: str,
        *,
        limit: int,
        ttl: float | None = None,
        timeout: float | None = None,
        blocking: bool = True,
    ) -> SlotLease:
        """Take and start keeping a slot of semaphore `key` (at most `limit` held at once).

        Waiters are admitted in arrival order. Release with `release(slot)`. Raises
        AcquireTimeout, or SemaphoreUnsupported on a backend without semaphores.
        """
        ttl = self.ttl if ttl is None else ttl
        timeout = (self.timeout if timeout is None else timeout) if blocking else 0.0
        slot = acquire_slot(
            self.backend,
            key,
            limit=limit,
            ttl=ttl,
            timeout=timeout,
            backoff=self.backoff,
            meta=default_meta(),
        )
        self.keeper.keep(slot)
        return slot

    @contextmanager
    def semaphore(
        self,
        key: str,
        *,
        limit: int,
        ttl: float | None = None,
        timeout: float | None = None,
        blocking: bool = True,
    ) -> Iterator[SlotLease]:
        """Hold one of `limit` slots of `key` for the block; the slot's `fence` strictly
        increases per key. Raises LeaseLost at exit if the slot was lost meanwhile.

        with locker.semaphore("account:42", limit=2, ttl=30) as slot:
            call_partner_api(..., fence=slot.fence)
        """
        slot = self.acquire_slot(key, limit=limit, ttl=ttl, timeout=timeout, blocking=blocking)
        ok = False
        try:
            yield slot
            ok = True
        finally:
            lost = slot.lost
            self.release(slot)
        if ok and lost:
            raise LeaseLost("semaphore slot lost while the block ran", key=key, fence=slot.fence)

    def locked(
        self, key: str, *, ttl: float | None = None, timeout: float | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorator: `key` may name arguments, e.g. "stock:{sku}"; the lease is not passed."""

        def wrap(fn: Callable[P, R]) -> Callable[P, R]:
            sig = inspect.signature(fn)

            @functools.wraps(fn)
            def inner(*args: P.args, **kwargs: P.kwargs) -> R:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                with self.lock(key.format(**bound.arguments), ttl=ttl, timeout=timeout):
                    return fn(*args, **kwargs)

            return inner

        return wrap

    @contextmanager
    def leader(
        self,
        name: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        blocking: bool = True,
        on_lost: TermCallback | None = None,
    ) -> Iterator[Term]:
        """Run the block as the leader of election `name` (lock key "leader:<name>").

        Waits until elected (for ever unless `timeout`; `blocking=False` tries once), raising
        AcquireTimeout otherwise. The block gets the Term: `term.fence` for fenced writes,
        `term.lost` (an Event) and `term.check()` to stop when leadership is lost, and
        `on_lost(term)` is called from a thread of its own if it is. Leaving the block
        resigns: the lease is released at once, so a standby takes over without waiting
        out the TTL. A lost term does not raise at exit: the block was told.
        """
        key = leader_key(name)
        ttl = self.ttl if ttl is None else ttl
        if blocking:
            term = elect(
                self.backend, self.keeper, key, ttl=ttl, timeout=timeout,
                backoff=self.backoff, observer=self.on_leadership,
            )  # fmt: skip
        else:
            got = try_elect(self.backend, self.keeper, key, ttl=ttl, observer=self.on_leadership)
            if got is None:
                raise AcquireTimeout("another process leads", key=key)
            term = got
        if on_lost is not None:
            term.watch(on_lost)
        try:
            yield term
        finally:
            term.resign()

    def campaign(
        self,
        name: str,
        *,
        ttl: float | None = None,
        on_elected: TermCallback | None = None,
        on_lost: TermCallback | None = None,
    ) -> LeaderElector:
        """Campaign for election `name` on a thread of its own, again after every lost term,
        until the returned elector's `stop()` (which resigns at once). Started already."""
        return LeaderElector(
            self.backend,
            self.keeper,
            leader_key(name),
            ttl=self.ttl if ttl is None else ttl,
            on_elected=on_elected,
            on_lost=on_lost,
            backoff=self.backoff,
            observer=self.on_leadership,
        ).start()

    def rate_limiter(
        self, key: str, rate: str | Rate, *, burst: int = 1, timeout: float | None = None
    ) -> RateLimiter:
        """A fleet-wide limiter named `key` ("api:stripe"), e.g. `rate="100/m"`: every
        process using the same lock server and key shares it (locks/ratelimit.py)."""
        return RateLimiter(self.backend, key, rate, burst=burst, timeout=timeout)

    def close(self) -> None:
        self.keeper.stop()
        self.backend.close()


def open_backend(url: str, **options: Any) -> LockBackend:
    """A backend for `url`'s scheme (locks/registry.py); optional backends are imported only
    when asked for, and a missing extra raises ModuleNotFoundError naming its install."""
    scheme = url.split("://", 1)[0]
    cls = registry.entry_for(url).load(scheme)
    # from_url is each backend's own keyword-only signature, so the base declares none.
    from_url: Callable[..., LockBackend] = getattr(cls, "from_url")  # noqa: B009
    return from_url(url, **options)
