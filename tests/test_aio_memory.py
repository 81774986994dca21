"""AsyncLocker through the thread offload on the memory:// backend: the shell's logic alone."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from jobfence import AsyncLocker, Locker
from jobfence.locks import AcquireTimeout, LeaseLost, MemoryBackend
from jobfence.locks.aio import ThreadStore


def _tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


def test_coroutines_exclude_each_other_and_fences_increase() -> None:
    async def main() -> list[tuple[float, float, int]]:
        locker = AsyncLocker.from_url("memory://", ttl=5)
        assert isinstance(locker.store, ThreadStore)
        held: list[tuple[float, float, int]] = []

        async def one() -> None:
            async with locker.lock("k", timeout=30) as lease:
                began = time.monotonic()
                await asyncio.sleep(0.001)
                held.append((began, time.monotonic(), lease.fence))

        await asyncio.gather(*(one() for _ in range(30)))
        await locker.aclose()
        return held

    held = sorted(asyncio.run(main()))
    assert len(held) == 30
    for (_, end, fence), (begin, _, later) in itertools.pairwise(held):
        assert begin >= end and later > fence


def test_the_keeper_task_renews_then_ends_with_the_last_lease() -> None:
    async def main() -> None:
        locker = AsyncLocker.from_url("memory://")
        async with locker.lock("k", ttl=0.3) as lease:
            await asyncio.sleep(1.0)  # three TTLs
            lease.check()
            assert len(_tasks()) == 1  # the keeper
        deadline = time.monotonic() + 5  # the keeper task ends on its next step: poll for it
        while _tasks():
            assert time.monotonic() < deadline, _tasks()
            await asyncio.sleep(0.01)
        await locker.aclose()

    asyncio.run(main())


def test_a_lease_lost_in_the_block_raises_at_exit() -> None:
    async def main() -> None:
        locker = AsyncLocker.from_url("memory://")
        with pytest.raises(LeaseLost):
            async with locker.lock("k", ttl=5) as lease:
                backend = locker.store.backend  # type: ignore[attr-defined]
                backend.force_release("k")
                backend.try_acquire("k", 5)  # a newer holder: the next extension is refused
                lease.mark_lost(LeaseLost("taken", key="k"))
        await locker.aclose()

    asyncio.run(main())


def test_a_timed_out_waiter_raises_and_the_holder_is_untouched() -> None:
    async def main() -> None:
        locker = AsyncLocker.from_url("memory://")
        async with locker.lock("k", ttl=5) as lease:
            with pytest.raises(AcquireTimeout):
                await locker.acquire("k", timeout=0.1)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await locker.acquire("k", timeout=30)
            lease.check()
            assert locker.keeper.held() == [lease]
        await locker.aclose()

    asyncio.run(main())


def test_sync_and_async_lockers_share_one_backend() -> None:
    backend = MemoryBackend()
    sync = Locker(backend)

    async def main() -> None:
        locker = AsyncLocker(ThreadStore(backend), clock=backend.clock)
        async with locker.lock("k", ttl=5) as lease:
            with pytest.raises(AcquireTimeout):
                await asyncio.to_thread(sync.acquire, "k", blocking=False)
        again = await asyncio.to_thread(sync.acquire, "k", blocking=False)
        assert again.fence > lease.fence
        sync.release(again)
        await locker.aclose()

    asyncio.run(main())
    sync.close()


def test_bad_input_names_the_field() -> None:
    with pytest.raises(Exception, match="AsyncLocker ttl"):
        AsyncLocker.from_url("memory://", ttl=0)
