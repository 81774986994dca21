"""The asyncio lock API: AsyncLocker, its terms of leadership and rate limiters (its keeper task:
aio_keeper.py; the stores a loop can await: aio_stores.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

import jobfence.locks.registry as registry
from jobfence.locks.aio_keeper import AsyncKeeper
from jobfence.locks.aio_stores import ThreadStore, open_async_store
from jobfence.locks.backend import RateGrant, default_meta, validate_seconds
from jobfence.locks.clock import Clock
from jobfence.locks.drive import AsyncStore, deliver_cancel, run_async
from jobfence.locks.errors import LeaseLost, LockError, RateLimited, RateLimitUnsupported
from jobfence.locks.flows import Backoff, acquire_flow, campaign_flow, rate_flow, slot_flow
from jobfence.locks.leader import LEADER_TASK_NAME, leader_key
from jobfence.locks.lease import Lease
from jobfence.locks.ops import Release
from jobfence.locks.ratelimit import Rate, parse_rate
from jobfence.locks.slots import SlotLease

log = logging.getLogger(__name__)


class AsyncTerm:
    """One term of leadership, for asyncio: `fence`, `lost` (an asyncio.Event set when the
    lease is lost), `leading` and `check()` (both read the lease's deadline too)."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.key = lease.key
        self.fence = lease.fence
        self.lost = asyncio.Event()
        loop = asyncio.get_running_loop()

        # A ThreadStore's extension marks the loss in a worker thread: set it on the loop.
        def ended(_lease: Lease, _cause: BaseException) -> None:
            loop.call_soon_threadsafe(self.lost.set)

        lease.on_lost(ended)

    @property
    def leading(self) -> bool:
        if self.lease.lost:
            self.lost.set()
        return not self.lost.is_set()

    def check(self) -> None:
        """Raise LeaseLost once the term has ended."""
        if not self.leading:
            raise LeaseLost("leadership lost", key=self.key, fence=self.fence)


class AsyncRateLimiter:
    """A fleet-wide GCRA limiter for asyncio: `await limiter.acquire()` reserves our turn in
    one round trip and sleeps it out without blocking the loop (locks/ratelimit.py)."""

    def __init__(self, locker: AsyncLocker, key: str, rate: Rate, timeout: float | None) -> None:
        self.locker = locker
        self.key = key
        self.rate = rate
        self.timeout = timeout

    async def acquire(self, timeout: float | None = None) -> float:
        """Wait for our turn, up to `timeout` seconds; returns the seconds waited. Raises
        RateLimited if the turn is further away."""
        timeout = self.timeout if timeout is None else timeout
        grant: RateGrant = await self.locker._run(rate_flow(self.key, self.rate, timeout=timeout))
        return grant.wait

    async def try_acquire(self) -> float:
        """0.0 if admitted now; else the seconds until a try would succeed (nothing taken)."""
        try:
            await self.locker._run(rate_flow(self.key, self.rate, timeout=0.0))
        except RateLimited as exc:
            return max(exc.retry_after, 1e-6)
        return 0.0

    async def __aenter__(self) -> AsyncRateLimiter:
        await self.acquire()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


class AsyncLocker:
    """The Locker for asyncio: the same flows, awaited; leases kept by an asyncio task.
    Use one per event loop (its store's connections belong to the loop that opened them).

    async with locker.lock("invoice:42", ttl=10, timeout=5) as lease:
        await write(..., fence=lease.fence)
    """

    def __init__(
        self,
        store: AsyncStore,
        *,
        clock: Clock,
        ttl: float = 30.0,
        timeout: float = 10.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.ttl = validate_seconds(ttl, "AsyncLocker ttl", positive=True)
        self.timeout = validate_seconds(timeout, "AsyncLocker timeout")
        self.backoff = backoff or Backoff()
        self.keeper = AsyncKeeper(store, clock)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        ttl: float = 30.0,
        timeout: float = 10.0,
        backoff: Backoff | None = None,
        **options: Any,
    ) -> AsyncLocker:
        """An AsyncLocker on any lock URL jobfence accepts (`options` go to the store)."""
        store = open_async_store(url, **options)
        clock: Clock = getattr(store, "clock")  # noqa: B009 - every store has its backend's
        return cls(store, clock=clock, ttl=ttl, timeout=timeout, backoff=backoff)

    async def _run(self, flow: Any) -> Any:
        return await run_async(flow, self.store, self.clock)

    async def acquire(
        self, key: str, *, ttl: float | None = None, timeout: float | None = None,
        blocking: bool = True,
    ) -> Lease:  # fmt: skip
        """Acquire `key` and keep it; release with `await release(lease)`."""
        flow = acquire_flow(
            key,
            ttl=self.ttl if ttl is None else ttl,
            timeout=(self.timeout if timeout is None else timeout) if blocking else 0.0,
            backoff=self.backoff,
            meta=default_meta(),
            blocking=blocking,
        )
        lease: Lease = await self._run(flow)
        self.keeper.keep(lease)
        return lease

    async def release(self, lease: Lease) -> bool:
        """Stop keeping `lease` and release it (owner-checked); False if it had moved on."""
        self.keeper.drop(lease)
        if lease.released:
            return False
        ok: bool = await deliver_cancel(self.store.execute_async(Release(lease)))
        return ok

    @contextlib.asynccontextmanager
    async def _held(self, lease: Lease, what: str) -> AsyncIterator[None]:
        """Release at exit, whatever ends the block (a cancellation too); LeaseLost at a
        normal exit if the lease was lost meanwhile."""
        ok = False
        try:
            yield
            ok = True
        finally:
            lost = lease.lost
            self.keeper.drop(lease)  # first: a release that fails leaves it to its TTL
            try:
                await self.release(lease)
            except LockError as exc:
                log.warning("release of %s failed; it lapses after its TTL: %s", lease.key,
                            type(exc).__name__)  # fmt: skip
        if ok and lost:
            raise LeaseLost(f"{what} lost while the block ran", key=lease.key, fence=lease.fence)

    @contextlib.asynccontextmanager
    async def lock(
        self, key: str, *, ttl: float | None = None, timeout: float | None = None,
        blocking: bool = True,
    ) -> AsyncIterator[Lease]:  # fmt: skip
        """Hold `key` for the block. Raises LeaseLost at exit if the lease was lost meanwhile."""
        lease = await self.acquire(key, ttl=ttl, timeout=timeout, blocking=blocking)
        async with self._held(lease, "lease"):
            yield lease

    @contextlib.asynccontextmanager
    async def semaphore(
        self, key: str, *, limit: int, ttl: float | None = None, timeout: float | None = None,
        blocking: bool = True,
    ) -> AsyncIterator[SlotLease]:  # fmt: skip
        """Hold one of `limit` slots of `key` for the block (waiters in arrival order)."""
        flow = slot_flow(
            key,
            limit=limit,
            ttl=self.ttl if ttl is None else ttl,
            timeout=(self.timeout if timeout is None else timeout) if blocking else 0.0,
            backoff=self.backoff,
            meta=default_meta(),
        )
        slot: SlotLease = await self._run(flow)
        self.keeper.keep(slot)
        async with self._held(slot, "semaphore slot"):
            yield slot

    @contextlib.asynccontextmanager
    async def leader(
        self, name: str, *, ttl: float | None = None, timeout: float | None = None
    ) -> AsyncIterator[AsyncTerm]:
        """Run the block as the leader of election `name` (waits for ever unless `timeout`).
        `term.lost` is set if leadership is lost; leaving the block resigns at once. A lost
        term does not raise at exit: the block was told."""
        flow = campaign_flow(
            leader_key(name),
            ttl=self.ttl if ttl is None else ttl,
            timeout=timeout,
            backoff=self.backoff,
            meta=default_meta(task_name=LEADER_TASK_NAME),
        )
        lease: Lease = await self._run(flow)
        term = AsyncTerm(lease)
        self.keeper.keep(lease)
        try:
            yield term
        finally:
            term.lost.set()
            self.keeper.drop(lease)
            with contextlib.suppress(LockError):
                await self.release(lease)

    def rate_limiter(
        self, key: str, rate: str | Rate, *, burst: int = 1, timeout: float | None = None
    ) -> AsyncRateLimiter:
        """A fleet-wide limiter named `key`, e.g. `rate="100/m"` (shared with sync users)."""
        caps = getattr(self.store, "capabilities", None)
        if caps is not None and not caps.rate_limit:
            name = getattr(self.store, "name", "this")
            raise RateLimitUnsupported(
                f"the {name} lock backend keeps no shared rate limits; use "
                f"{registry.backends_with('rate_limit')}",
                key=key,
            )
        parsed = parse_rate(rate, option="rate", burst=burst) if isinstance(rate, str) else rate
        if timeout is not None:
            validate_seconds(timeout, "timeout")
        return AsyncRateLimiter(self, key, parsed, timeout)

    async def aclose(self) -> None:
        """Stop the keeper task and close the store (held leases lapse after their TTL)."""
        await self.keeper.aclose()
        close: Callable[[], Any] | None = getattr(self.store, "aclose", None)
        if close is not None:
            await close()

    async def __aenter__(self) -> AsyncLocker:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


__all__ = ["AsyncKeeper", "AsyncLocker", "AsyncRateLimiter", "AsyncTerm",
           "ThreadStore", "open_async_store"]  # fmt: skip
