"""The asyncio Redis store's lane (locks/backends/redis/async_lane.py) on private redis-servers:
its login (an ACL user, a database), a lost script cache, commands whose callers stopped
waiting on a stopped server, a timeout, a restarted server and a second event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from devstack.redis_server import RedisServer
from jobfence.locks import AcquireTimeout, BackendUnavailable
from jobfence.locks.aio import AsyncLocker
from jobfence.locks.backends.redis.async_store import AsyncRedisStore
from jobfence.locks.lease import Lease

pytestmark = pytest.mark.server

USER, PASSWORD = "lane", "Lane-pw-5150"
TIMEOUT = 1.0  # the store's socket timeout: each reply, the connect and the login


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A private redis-server with an ACL user of its own besides the default one."""
    acl = [USER, "on", f">{PASSWORD}", "~*", "&*", "+@all"]  # one word an argument
    with RedisServer(password="default-pw-1", extra_args=["--user", *acl]) as s:
        yield s


def _url(server: RedisServer, password: str = PASSWORD, db: int = 3) -> str:
    return f"redis://{USER}:{password}@{server.host}:{server.port}/{db}"


def _locker(server: RedisServer, timeout: float = TIMEOUT, **kwargs: object) -> AsyncLocker:
    return AsyncLocker.from_url(_url(server, **kwargs), prefix=f"lane-{uuid.uuid4().hex[:6]}",  # type: ignore[arg-type]
                                socket_timeout=timeout)  # fmt: skip


def _store(locker: AsyncLocker) -> AsyncRedisStore:
    store = locker.store
    assert isinstance(store, AsyncRedisStore) and store.lane is not None
    return store


def _admin(server: RedisServer, db: int = 3) -> redis.Redis:
    return redis.Redis(host=server.host, port=server.port, db=db, username=USER,
                       password=PASSWORD, decode_responses=True)  # fmt: skip


def test_the_lane_logs_in_as_the_urls_user_into_its_database(server: RedisServer) -> None:
    async def run() -> tuple[int, bool]:
        locker = _locker(server)
        try:
            lease = await locker.acquire("job", ttl=5, blocking=False)
            assert lease is not None
            with _admin(server) as admin:  # the lock is in database 3, the URL's
                held = admin.exists(_store(locker).keys.lock("job"))
            return held, await locker.release(lease)
        finally:
            await locker.aclose()

    assert asyncio.run(run()) == (1, True)


def test_a_wrong_password_is_unavailable_and_never_shown(server: RedisServer) -> None:
    async def run() -> BackendUnavailable:
        locker = _locker(server, password="Wrong-pw-77")
        try:
            with pytest.raises(BackendUnavailable) as caught:
                await locker.acquire("job", ttl=5, blocking=False)
            return caught.value
        finally:
            await locker.aclose()

    error = asyncio.run(run())
    assert isinstance(error.__cause__, redis.AuthenticationError)
    assert "Wrong-pw-77" not in str(error) and "Wrong-pw-77" not in repr(error.__cause__)


def test_a_flushed_script_cache_is_loaded_again(server: RedisServer) -> None:
    async def run() -> bool:
        locker = _locker(server)
        try:
            first = await locker.acquire("a", ttl=5, blocking=False)
            assert first is not None and await locker.release(first)
            with _admin(server) as admin:
                admin.script_flush()
            again = await locker.acquire("a", ttl=5, blocking=False)  # NOSCRIPT, loaded, sent
            assert again is not None and again.fence > first.fence
            return await locker.release(again)
        finally:
            await locker.aclose()

    assert asyncio.run(run())


def test_callers_that_stop_waiting_on_a_stopped_server_leave_the_others_their_own_replies(
    server: RedisServer,
) -> None:
    """Twenty grants go out to a stopped server; half their callers give up (cancelled: each
    sends the release of its unread grant). Resumed, the server answers all thirty in order:
    each caller still waiting gets the grant of its own key, each cancelled grant is freed,
    and the next commands get their own replies."""
    keys = [f"k{i}" for i in range(20)]

    async def run() -> tuple[list[Lease], int, int]:
        locker = _locker(server)
        store = _store(locker)
        try:
            warm = await locker.acquire("warm", ttl=5, blocking=False)  # connected, logged in
            assert warm is not None and await locker.release(warm)
            with server.suspended():
                tasks = [asyncio.create_task(locker.acquire(k, ttl=30, blocking=False))
                         for k in keys]  # fmt: skip
                lane = store.lane
                assert lane is not None and lane.wire is not None
                deadline = time.monotonic() + TIMEOUT / 2  # within the commands' timeout
                while len(lane.wire.futures) < len(keys):  # every grant written, unanswered
                    assert time.monotonic() < deadline, len(lane.wire.futures)
                    await asyncio.sleep(0.005)
                for task in tasks[::2]:
                    task.cancel()
            got = [await t for t in tasks[1::2]]
            for task in tasks[::2]:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            after = await locker.acquire("after", ttl=5, blocking=False)
            assert after is not None and after.key == "after"
            with _admin(server) as admin:
                held = sum(admin.exists(store.keys.lock(k)) for k in keys[1::2])
                freed = sum(not admin.exists(store.keys.lock(k)) for k in keys[::2])
            for lease in [*got, after]:
                assert lease is not None and await locker.release(lease)
            return got, held, freed
        finally:
            await locker.aclose()

    got, held, freed = asyncio.run(run())
    assert [lease.key if lease else None for lease in got] == keys[1::2]
    assert held == len(keys[1::2])  # the grants the waiting callers read
    assert freed == len(keys[::2])  # the cancelled grants, released after their unread replies


def test_a_stopped_server_times_out_and_its_late_reply_goes_to_nobody(server: RedisServer) -> None:
    async def run() -> tuple[float, bool]:
        locker = _locker(server)
        try:
            warm = await locker.acquire("warm", ttl=5, blocking=False)
            assert warm is not None and await locker.release(warm)
            with server.suspended():
                started = time.monotonic()
                with pytest.raises(BackendUnavailable) as caught:
                    await locker.acquire("late", ttl=30, blocking=False)
                took = time.monotonic() - started
                assert isinstance(caught.value.__cause__, redis.TimeoutError)
            # The late grant's reply comes first on the connection: it is dropped, and this
            # command gets its own (busy: the late grant ran when the server woke).
            with pytest.raises(AcquireTimeout):
                await locker.acquire("late", ttl=30, blocking=False)
            other = await locker.acquire("other", ttl=5, blocking=False)
            assert other is not None and other.key == "other"
            return took, await locker.release(other)
        finally:
            await locker.aclose()

    took, released = asyncio.run(run())
    assert TIMEOUT <= took < TIMEOUT + 5.0  # within its timeout, not the server's pause
    assert released


def test_a_restarted_server_is_reached_again_and_a_second_loop_gets_its_own_connection() -> None:
    with RedisServer() as plain:
        url = plain.db_url(2)
        locker = AsyncLocker.from_url(url, prefix="lane-r", socket_timeout=TIMEOUT)

        async def pair(key: str) -> bool:
            lease = await locker.acquire(key, ttl=5, blocking=False)
            return lease is not None and await locker.release(lease)

        async def across_a_restart() -> bool:
            assert await pair("one")
            plain.kill()
            with pytest.raises(BackendUnavailable):
                await pair("down")
            plain.start()
            return await pair("two")  # a new connection, the scripts loaded again

        try:
            assert asyncio.run(across_a_restart())
            assert asyncio.run(pair("three"))  # another event loop
        finally:
            asyncio.run(locker.aclose())


def test_a_unix_socket_url_is_reached_through_its_socket(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    with RedisServer(extra_args=["--unixsocket", str(sock), "--unixsocketperm", "700"]) as s:
        locker = AsyncLocker.from_url(f"unix://{sock}?db=4", prefix="lane-u",
                                      socket_timeout=TIMEOUT)  # fmt: skip

        async def run() -> bool:
            try:
                lease = await locker.acquire("job", ttl=5, blocking=False)
                assert _store(locker).lane is not None
                assert _store(locker).lane.address.path == str(sock)  # type: ignore[union-attr]
                with s.client(db=4) as admin:  # over TCP: the lock is in database 4
                    held = admin.exists(_store(locker).keys.lock("job"))
                return bool(held) and await locker.release(lease)
            finally:
                await locker.aclose()

        assert asyncio.run(run())


def test_five_thousand_coroutines_at_once_are_served_in_order_on_one_connection(
    server: RedisServer,
) -> None:
    """Far past redis.asyncio's pool of 32: every grant comes back to its own caller."""
    keys = [f"many-{i}" for i in range(5000)]

    async def run() -> list[str]:
        locker = _locker(server, timeout=60.0)  # the last reply waits for all before it
        try:
            leases = await asyncio.gather(
                *(locker.acquire(k, ttl=30, blocking=False) for k in keys)
            )
            released = await asyncio.gather(*(locker.release(le) for le in leases))
            assert all(released)
            return [le.key for le in leases]
        finally:
            await locker.aclose()

    assert asyncio.run(run()) == keys
