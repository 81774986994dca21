"""AsyncLocker on real servers: one loop and four processes contend, leases outlive their TTL,
cancellation leaves nothing behind, the loop stays responsive, and a frozen holder is fenced."""

from __future__ import annotations

import asyncio
import statistics
import sys
import textwrap
import time
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from jobfence import AsyncLocker, Lease, Locker
from jobfence.locks import AcquireTimeout, AsyncRedisFenceGuard, open_backend
from jobfence.locks.aio import ThreadStore
from jobfence.locks.backends.postgres.async_store import AsyncPostgresStore
from jobfence.locks.backends.redis.async_store import AsyncRedisStore
from jobfence.locks.backends.redis.semaphores import semaphore_keys
from jobfence.locks.clock import SYSTEM_CLOCK
from jobfence.locks.drive import run_async
from jobfence.locks.flows import slot_flow
from jobfence.locks.ops import Now, Sleep, TakeSlot
from jobfence.locks.slots import SlotWait
from tests.contend import Hold, assert_exclusive_and_fenced, contend
from tests.frozen import frozen_holder

KEY = "contended"
COROUTINES = 200
PROCESSES = 4
PER_PROCESS = 25


def _contend(url: str, coroutines: int, *, offload: bool = False) -> list[Hold]:
    """`coroutines` async holders in this loop and PROCESSES sync ones elsewhere, one key."""

    def make() -> AsyncLocker:
        if offload:  # the thread offload every backend without a native store runs on
            backend = open_backend(url)
            return AsyncLocker(ThreadStore(backend), clock=backend.clock, ttl=10, timeout=120)
        return AsyncLocker.from_url(url, ttl=10, timeout=120)

    return contend(url, make, key=KEY, coroutines=coroutines, processes=PROCESSES,
                   per_process=PER_PROCESS)  # fmt: skip


def test_async_and_sync_holders_exclude_each_other_on_redis(redis_url: str) -> None:
    held = _contend(redis_url, COROUTINES)
    assert_exclusive_and_fenced(held, COROUTINES + PROCESSES * PER_PROCESS)


@pytest.mark.parametrize("offload", [False, True], ids=["native", "thread-offload"])
def test_async_and_sync_holders_exclude_each_other_on_postgres(pg_url: str, offload: bool) -> None:
    held = _contend(pg_url, COROUTINES, offload=offload)
    assert_exclusive_and_fenced(held, COROUTINES + PROCESSES * PER_PROCESS)


def test_async_stores_are_native_on_redis_and_postgres(redis_url: str, pg_url: str) -> None:
    async def main() -> None:
        for url, kind in [(redis_url, AsyncRedisStore), (pg_url, AsyncPostgresStore),
                          ("memory://", ThreadStore)]:  # fmt: skip
            locker = AsyncLocker.from_url(url)
            assert isinstance(locker.store, kind)
            await locker.aclose()

    asyncio.run(main())


def test_holder_awaiting_three_ttls_keeps_its_lease(redis_url: str) -> None:
    backend = open_backend(redis_url)

    async def main() -> None:
        locker = AsyncLocker.from_url(redis_url)
        async with locker.lock("long", ttl=0.6, timeout=5) as lease:
            await asyncio.sleep(1.9)  # more than three TTLs
            lease.check()
            info = backend.inspect("long")
            assert info is not None and info.fence == lease.fence
        assert backend.inspect("long") is None
        await locker.aclose()

    asyncio.run(main())
    backend.close()


async def _until(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _other_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


class _LateCancelStore:
    """A store whose first TakeSlot reply and a cancel of its caller land in one loop tick,
    answered through asyncio.wait_for as redis.asyncio sends every command: on Python 3.11
    wait_for returns the reply and loses the cancel (CPython gh-86296)."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    async def execute_async(self, op: Any) -> Any:
        self.ops.append(type(op).__name__)
        reply = asyncio.ensure_future(self._reply(op))
        await reply  # the reply is in ...
        if self.ops.count("TakeSlot") == 1 and type(op) is TakeSlot:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # ... and the cancel lands with it
        return await asyncio.wait_for(reply, 10)

    async def _reply(self, op: Any) -> Any:
        return SlotWait(position=0, ttl_left=30.0) if type(op) is TakeSlot else True


def test_cancel_lost_inside_an_op_still_ends_the_wait() -> None:
    store = _LateCancelStore()

    async def wait(run: Any) -> None:
        await run(slot_flow("sem", limit=1, ttl=30, timeout=0.3), store, SYSTEM_CLOCK)

    async def naive(flow: Any, store: Any, clock: Any) -> Any:  # the driver, unguarded
        reply: Any = None
        while True:
            try:
                op = flow.send(reply)
            except StopIteration as stop:
                return stop.value
            reply = clock.monotonic() if type(op) is Now else (
                await asyncio.sleep(op.seconds) if type(op) is Sleep
                else await store.execute_async(op))  # fmt: skip

    if sys.version_info < (3, 12):  # the control: 3.11's wait_for loses it, the wait runs on
        with pytest.raises(AcquireTimeout):
            asyncio.run(wait(naive))
        assert store.ops.count("TakeSlot") > 1
    store.ops.clear()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(wait(run_async))
    assert store.ops == ["TakeSlot", "LeaveSlot"]  # cancelled at once, its place given up


def test_cancelled_waiter_leaves_nothing_behind(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)

    async def main() -> None:
        locker = AsyncLocker.from_url(redis_url)
        holder = await locker.acquire("w", ttl=30)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await locker.acquire("w", ttl=30, timeout=60)
        # A semaphore waiter cancelled in the queue gives its place up.
        took, leave = asyncio.Event(), asyncio.Event()

        async def take_slot() -> None:
            async with locker.semaphore("sem", limit=1, ttl=30):
                took.set()
                await leave.wait()

        first = asyncio.ensure_future(take_slot())
        await took.wait()
        waiter = asyncio.ensure_future(take_slot())
        queue = semaphore_keys("jobfence", "sem")[1]
        await _until(lambda: client.zcard(queue) == 1, 10)  # it waits in the queue
        waiter.cancel()
        await asyncio.wait([waiter], timeout=5)  # its own timeout is 10 s: only the cancel
        assert waiter.cancelled(), "the cancel was not delivered"
        assert client.zcard(queue) == 0
        assert len(locker.keeper.held()) == 2  # the lock and the first slot, no more
        leave.set()
        await first
        await locker.release(holder)
        assert not locker.keeper.held()
        await _until(lambda: _other_tasks() == [], 5)  # the keeper task ends with its last lease
        async with locker.lock("w", ttl=30, blocking=False):
            pass  # free at once: no grant left behind
        await locker.aclose()

    asyncio.run(main())
    client.close()


@pytest.mark.parametrize("server", ["redis_url", "pg_url"])
def test_cancelled_holder_releases_at_once(server: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(server)
    backend = open_backend(url)

    async def main() -> None:
        locker = AsyncLocker.from_url(url)
        entered = asyncio.Event()

        async def hold() -> None:
            async with locker.lock("h", ttl=30):
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.ensure_future(hold())
        await entered.wait()
        assert backend.inspect("h") is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.inspect("h") is None  # released, not left to its 30 s TTL
        assert not locker.keeper.held()
        await _until(lambda: _other_tasks() == [], 5)
        await locker.aclose()

    asyncio.run(main())
    backend.close()


def test_loop_lag_while_a_thousand_leases_are_renewed(redis_url: str) -> None:
    async def main() -> list[float]:
        locker = AsyncLocker.from_url(redis_url)
        leases: list[Lease] = []
        for start in range(0, 1000, 100):  # in waves: a storm of 1,000 connects is not the point
            leases += await asyncio.gather(
                *(locker.acquire(f"many:{i}", ttl=2.0) for i in range(start, start + 100))
            )
        lags: list[float] = []
        until = time.monotonic() + 4.0  # six renewal rounds of 1,000 leases
        while time.monotonic() < until:
            before = time.monotonic()
            await asyncio.sleep(0.001)
            lags.append(time.monotonic() - before - 0.001)
        assert not any(lease.lost for lease in leases)
        await asyncio.gather(*(locker.release(lease) for lease in leases))
        await locker.aclose()
        return lags

    lags = sorted(asyncio.run(main()))
    p99 = lags[int(len(lags) * 0.99)]
    print(f"\nloop lag with 1,000 leases renewed: median {statistics.median(lags) * 1000:.2f} ms, "
          f"p99 {p99 * 1000:.2f} ms, max {lags[-1] * 1000:.2f} ms ({len(lags)} ticks)")  # fmt: skip


FROZEN_HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from jobfence import AsyncLocker
    from jobfence.locks import AsyncRedisFenceGuard, LeaseLost, StaleFence

    async def main(url):
        locker = AsyncLocker.from_url(url)
        guard = AsyncRedisFenceGuard(Redis.from_url(url, retry=Retry(NoBackoff(), 0)))
        async with locker.lock("acct", ttl=1.0) as lease:
            print("HELD", lease.fence, flush=True)
            sys.stdin.readline()  # the parent SIGSTOPs us here, and lets us go on later
            try:
                await guard.write("acct", lease.fence, [("SET", "balance", "stale")])
                print("WROTE", flush=True)
            except StaleFence:
                print("REFUSED", flush=True)

    try:
        asyncio.run(main(sys.argv[1]))
    except LeaseLost:  # at the block's exit: the lease was lost while it ran (the point)
        pass
    """
)


@pytest.mark.parametrize("guarded", [True, False], ids=["fenced", "naive-control"])
def test_sigstopped_async_holder_late_write_is_refused(redis_url: str, guarded: bool) -> None:
    """The holder freezes past its TTL; a newer holder writes; the frozen one wakes and writes
    late. Fenced: refused. The control (a plain SET with no fence) overwrites the newer value."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    script = FROZEN_HOLDER if guarded else FROZEN_HOLDER.replace(
        'await guard.write("acct", lease.fence, [("SET", "balance", "stale")])',
        'await guard.client.set("balance", "stale")',
    )  # fmt: skip
    try:
        with frozen_holder(script, redis_url) as holder:

            async def newer() -> int:
                locker = AsyncLocker.from_url(redis_url)
                guard = AsyncRedisFenceGuard(
                    redis.asyncio.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 0))
                )
                async with locker.lock("acct", ttl=10, timeout=30) as lease:  # after the TTL
                    await guard.write("acct", lease.fence, [("SET", "balance", "new")])
                    fence = lease.fence
                await guard.client.aclose()
                await locker.aclose()
                return fence

            assert asyncio.run(newer()) > holder.fence
            verdict = holder.thaw()
        if guarded:
            assert verdict == "REFUSED"
            assert client.get("balance") == "new"
        else:
            assert verdict == "WROTE"
            assert client.get("balance") == "stale"  # the lost update a fence prevents
    finally:
        client.close()


def test_rate_limiter_and_leader_from_asyncio(redis_url: str) -> None:
    async def main() -> None:
        locker = AsyncLocker.from_url(redis_url)
        limiter = locker.rate_limiter("api", "20/s")
        began = time.monotonic()
        for _ in range(5):
            await limiter.acquire()
        assert time.monotonic() - began >= 4 * 0.05 * 0.9  # spaced one interval apart
        assert await limiter.try_acquire() > 0
        async with locker.leader("reports", ttl=1) as term:
            assert term.leading
            with pytest.raises(AcquireTimeout):
                async with locker.leader("reports", ttl=1, timeout=0.2):
                    pass
        assert term.lost.is_set()
        await locker.aclose()

    asyncio.run(main())


def test_sync_locker_waits_are_woken_by_an_async_release(redis_url: str) -> None:
    """One fence space, one release signal: a sync waiter wakes on an async holder's release."""
    locker = Locker.from_url(redis_url)

    async def main() -> float:
        alock = AsyncLocker.from_url(redis_url)
        async with alock.lock("shared", ttl=30) as lease:
            waiter = asyncio.ensure_future(asyncio.to_thread(locker.acquire, "shared",
                                                             timeout=20))  # fmt: skip
            await asyncio.sleep(0.3)
            released = time.monotonic()
        sync_lease = await waiter
        woke = time.monotonic() - released
        assert sync_lease.fence > lease.fence
        locker.release(sync_lease)
        await alock.aclose()
        return woke

    woke = asyncio.run(main())
    print(f"\nsync waiter woke {woke * 1000:.1f} ms after the async release")
    locker.close()
