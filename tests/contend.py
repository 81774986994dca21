"""Coroutines in one loop and sync Lockers in other processes contend for one key: the harness
the asyncio tests share, and the check that no two held it at once and fences rose in order."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import time
from collections.abc import Callable
from typing import Any

from jobfence import AsyncLocker, Locker
from jobfence.locks import open_backend

Hold = tuple[float, float, int]  # (began, ended, fence), on the host's one monotonic clock


def _sync_contender(url: str, prefix: str, key: str, grants: int, start: Any, out: Any) -> None:
    """A sync Locker in another process: `grants` grants of `key`, each (began, ended, fence)."""
    locker = Locker(open_backend(url, prefix=prefix), ttl=10, timeout=120)
    start.wait(60)
    held = []
    for _ in range(grants):
        with locker.lock(key) as lease:
            began = time.monotonic()  # one clock for every process on this host
            time.sleep(0.001)  # the holder's work
            held.append((began, time.monotonic(), lease.fence))
    locker.close()
    out.put(held)


def contend(
    url: str,
    make: Callable[[], AsyncLocker],
    *,
    key: str,
    coroutines: int,
    processes: int,
    per_process: int,
    prefix: str = "jobfence",
) -> list[Hold]:
    """`coroutines` holders on `make()`'s locker in this loop and `processes` sync ones
    elsewhere (`per_process` grants each) take `key`; every hold, in no order."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_sync_contender, args=(url, prefix, key, per_process, start, out))
             for _ in range(processes)]  # fmt: skip
    for proc in procs:
        proc.start()

    async def main() -> list[Hold]:
        locker = make()
        held: list[Hold] = []

        async def one() -> None:
            async with locker.lock(key) as lease:
                began = time.monotonic()
                await asyncio.sleep(0.001)  # the holder's work
                held.append((began, time.monotonic(), lease.fence))

        start.set()
        await asyncio.gather(*(one() for _ in range(coroutines)))
        assert not locker.keeper.held()
        await locker.aclose()
        return held

    try:
        held = asyncio.run(main())
        for _ in procs:
            held += out.get(timeout=180)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return held


def assert_exclusive_and_fenced(held: list[Hold], expected: int) -> None:
    """`expected` holds, no two overlapping, fences strictly increasing in grant order."""
    assert len(held) == expected
    held.sort()
    for (_, end, fence), (begin, _, next_fence) in itertools.pairwise(held):
        assert begin >= end, "two holders overlapped"
        assert next_fence > fence, "fences not strictly increasing in grant order"
