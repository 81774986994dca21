"""The Redis lane's packer: the bytes redis-py would send, through hiredis's C packer."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from redis.connection import Connection, ConnectionPool

from jobfence.locks import RedisBackend
from jobfence.locks.backends.redis import lane as redis_lane
from jobfence.locks.backends.redis.lane import Lane

ARGS: list[tuple[Any, ...]] = [
    ("EVALSHA", "a" * 40, 3, "jobfence:lock:{t:ab}", "jobfence:fences", "k", "owner", 1800000),
    ("X", 0.1, 1e20, 1 / 3, 2**70, -5, 0, ""),
    ("X", b"\xff\x00", "é€😀", "line\nbreak", "a b"),
]


def _redis_py_bytes(pool: ConnectionPool, args: tuple[Any, ...]) -> bytes:
    conn = Connection(**pool.connection_kwargs)  # type: ignore[no-untyped-call]
    return b"".join(conn.pack_command(*args))  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("args", ARGS)
def test_the_lane_packs_what_redis_py_packs(args: tuple[Any, ...]) -> None:
    pool = ConnectionPool.from_url("redis://127.0.0.1:1/0", decode_responses=True)
    lane = Lane(pool)
    assert redis_lane._pack_big is not None  # hiredis is a core dependency
    assert lane.pack is redis_lane._pack_big  # the C packer on a UTF-8 pool
    assert lane.pack(args) == _redis_py_bytes(pool, args)
    assert lane.pack_py(args) == _redis_py_bytes(pool, args)  # the fallback too


@pytest.mark.parametrize("bad", [True, None, object()])
def test_the_lane_refuses_what_redis_py_refuses(bad: Any) -> None:
    lane = Lane(ConnectionPool.from_url("redis://127.0.0.1:1/0"))
    with pytest.raises((TypeError, redis.DataError)):
        lane.pack(("X", bad))


def test_a_pool_with_another_encoding_keeps_the_python_packer(redis_url: str) -> None:
    """hiredis encodes text as UTF-8 only: a latin-1 pool's text must reach the server as
    latin-1, as redis-py would send it."""
    pool = ConnectionPool.from_url(redis_url, encoding="latin-1")
    lane = Lane(pool)
    assert lane.pack == lane.pack_py
    assert lane.call("SET", "lane:latin1", "é") in (b"OK", "OK")
    raw = redis.Redis.from_url(redis_url)
    try:
        assert raw.get("lane:latin1") == "é".encode("latin-1")
    finally:
        raw.delete("lane:latin1")
        raw.close()
        lane.close()
        pool.disconnect()


def test_backend_calls_go_through_the_c_packer(redis_url: str) -> None:
    backend = RedisBackend.from_url(redis_url)
    try:
        assert backend._lane is not None and backend._lane.pack is redis_lane._pack_big
        lease = backend.try_acquire("lane:pair", 5)
        assert lease is not None and lease.release()
    finally:
        backend.close()
