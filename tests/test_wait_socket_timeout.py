"""A blocking acquire waits out a live holder whatever the socket timeout (issue 29, defect 10).

A user who lowers the socket timeout to fail fast on a dead server must still be able to wait
on a live one: Redis answers a BLPOP that timed out on its next event-loop tick (up to 100 ms
past the block at the default hz), so a waiter that blocked for 0.8 of a 0.15 s socket timeout
read its reply past that timeout, and `acquire(timeout=5)` raised BackendUnavailable after a
second (control: `test_a_plain_blpop_read_with_the_socket_timeout_times_out`).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest
import redis

from jobfence import AsyncLocker, Locker
from jobfence.locks.backends.redis import RedisBackend
from jobfence.locks.backends.redis.cluster import RedisClusterBackend

pytestmark = pytest.mark.slow

SOCKET_TIMEOUT = 0.15  # far below the holder's time: many blocked waits, each read on the edge
HOLD = 1.5  # the live holder keeps the key this long, then releases
WAIT = 10.0  # the waiter's own timeout: far above HOLD


def _release_later(locker: Locker, key: str) -> threading.Timer:
    lease = locker.acquire(key, ttl=10)
    timer = threading.Timer(HOLD, locker.release, (lease,))
    timer.start()
    return timer


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_a_blocking_acquire_with_a_short_socket_timeout_waits_for_a_live_holder(
    kind: str, request: pytest.FixtureRequest
) -> None:
    prefix, key = f"wst-{uuid.uuid4().hex[:8]}", "job"
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        holder = RedisBackend.from_url(url, prefix=prefix)
        waiter = RedisBackend.from_url(url, prefix=prefix, socket_timeout=SOCKET_TIMEOUT)
    else:
        url = request.getfixturevalue("redis_cluster").url
        holder = RedisClusterBackend.from_url(url, prefix=prefix)
        waiter = RedisClusterBackend.from_url(url, prefix=prefix, socket_timeout=SOCKET_TIMEOUT)
    held, waiting = Locker(holder), Locker(waiter)
    timer = _release_later(held, key)
    try:
        lease = waiting.acquire(key, ttl=10, timeout=WAIT)  # raised BackendUnavailable on main
        assert lease.fence > 0
        waiting.release(lease)
    finally:
        timer.join()
        held.close()
        waiting.close()


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_an_async_blocking_acquire_with_a_short_socket_timeout_waits_for_a_live_holder(
    kind: str, request: pytest.FixtureRequest
) -> None:
    prefix, key = f"wst-{uuid.uuid4().hex[:8]}", "job"
    url = request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster")
    url = url if isinstance(url, str) else url.url
    holder = Locker.from_url(url, prefix=prefix)

    async def main() -> None:
        waiting = AsyncLocker.from_url(
            url, prefix=prefix, ttl=10, timeout=WAIT, socket_timeout=SOCKET_TIMEOUT
        )
        try:
            lease = await waiting.acquire(key)  # raised BackendUnavailable on main
            assert lease.fence > 0
            await waiting.release(lease)
        finally:
            await waiting.aclose()

    timer = _release_later(holder, key)
    try:
        asyncio.run(main())
    finally:
        timer.join()
        holder.close()


def test_a_plain_blpop_read_with_the_socket_timeout_times_out(redis_url: str) -> None:
    """The control: the reply to a BLPOP blocked for 0.8 of the socket timeout (what the
    waiter sent on main) comes later than that timeout, on a quiet server too."""
    client: Any = redis.Redis.from_url(redis_url, socket_timeout=SOCKET_TIMEOUT)
    name = f"wst-{uuid.uuid4().hex[:8]}"
    timeouts = 0
    try:
        for _ in range(10):
            try:
                client.blpop([name], timeout=0.8 * SOCKET_TIMEOUT)
            except redis.TimeoutError:
                timeouts += 1
    finally:
        client.close()
    assert timeouts > 0
