"""Property tests: fences only grow per key, and guards accept exactly the non-stale tokens."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobfence.locks import (
    LockBackend,
    ManualClock,
    MemoryBackend,
    NotOwner,
    RedisBackend,
    RedisFenceGuard,
    SqlFenceGuard,
    StaleFence,
)
from jobfence.locks.backend import validate_ttl
from jobfence.locks.lease import Lease
from tests.servers import RedisServer

KEYS = ["a", "b", "c"]
FAST = settings(max_examples=60, deadline=None)
SLOW = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

lease_ref = st.integers(min_value=0, max_value=30)
lock_ops = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(KEYS), st.sampled_from([0.5, 1.0, 2.5])),
    st.tuples(st.just("release"), lease_ref),
    st.tuples(st.just("extend"), lease_ref),
    st.tuples(st.just("extend_many"), st.lists(lease_ref, max_size=4)),
    st.tuples(st.just("force_release"), st.sampled_from(KEYS)),
    st.tuples(st.just("advance"), st.floats(min_value=0, max_value=3, allow_nan=False)),
)


@dataclass
class Holder:
    lease: Lease
    expires: float


class LockModel:
    """What the backend must do: one live holder per key, fences strictly increasing."""

    def __init__(self, backend: LockBackend, now: Any) -> None:
        self.backend = backend
        self.now = now
        self.holders: dict[str, Holder] = {}
        self.granted: dict[str, list[int]] = {k: [] for k in KEYS}
        self.leases: list[Lease] = []

    def live(self, key: str) -> Holder | None:
        h = self.holders.get(key)
        if h is not None and h.expires <= self.now():
            del self.holders[key]
            return None
        return h

    def owns(self, lease: Lease) -> bool:
        h = self.live(lease.key)
        return h is not None and h.lease is lease

    def pick(self, i: int) -> Lease | None:
        return self.leases[i % len(self.leases)] if self.leases else None

    def apply(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "acquire":
            _, key, ttl = op
            free = self.live(key) is None
            lease = self.backend.try_acquire(key, ttl)
            assert (lease is not None) == free, f"{key}: granted={lease is not None} free={free}"
            if lease is not None:
                assert all(lease.fence > f for f in self.granted[key]), "fence went backwards"
                self.granted[key].append(lease.fence)
                self.holders[key] = Holder(lease, self.now() + validate_ttl(ttl) / 1000)
                self.leases.append(lease)
        elif kind == "release":
            lease = self.pick(op[1])
            if lease is not None:
                expected = self.owns(lease)
                assert self.backend.release(lease) is expected
                if expected:
                    del self.holders[lease.key]
        elif kind == "extend":
            lease = self.pick(op[1])
            if lease is not None:
                if self.owns(lease):
                    self.backend.extend(lease)
                    self.holders[lease.key].expires = self.now() + validate_ttl(lease.ttl) / 1000
                else:
                    with pytest.raises(NotOwner):
                        self.backend.extend(lease)
                    assert lease.lost
        elif kind == "extend_many":
            chosen = [le for i in op[1] if (le := self.pick(i)) is not None]
            chosen = list({id(le): le for le in chosen}.values())
            expected = [self.owns(le) for le in chosen]
            assert self.backend.extend_many(chosen) == expected
            for le, ok in zip(chosen, expected, strict=True):
                if ok:
                    self.holders[le.key].expires = self.now() + validate_ttl(le.ttl) / 1000
                else:
                    assert le.lost
        elif kind == "force_release":
            self.backend.force_release(op[1])
            self.holders.pop(op[1], None)
        elif kind == "advance":
            op_clock = self.backend.clock
            assert isinstance(op_clock, ManualClock)
            op_clock.advance(op[1])
        self.check()

    def check(self) -> None:
        for key in KEYS:
            info = self.backend.inspect(key)
            h = self.live(key)
            assert (info is None) == (h is None), f"{key}: server {info}, model {h}"
            if info is not None and h is not None:
                assert info.fence == h.lease.fence


@FAST
@given(st.lists(lock_ops, max_size=60))
def test_memory_backend_follows_the_model(ops: list[tuple[Any, ...]]) -> None:
    clock = ManualClock()
    model = LockModel(MemoryBackend(clock=clock), clock.monotonic)
    for op in ops:
        model.apply(op)


untimed_ops = lock_ops.filter(lambda op: op[0] != "advance")


@SLOW
@given(st.lists(untimed_ops, max_size=40))
def test_redis_backend_follows_the_model(
    redis_server: RedisServer, ops: list[tuple[Any, ...]]
) -> None:
    backend = RedisBackend.from_url(redis_server.url, prefix=f"prop{uuid.uuid4().hex[:8]}")
    try:
        # Long TTLs: nothing expires during an example, so the model needs no clock.
        model = LockModel(backend, lambda: 0.0)
        for op in ops:
            if op[0] == "acquire":
                op = (op[0], op[1], 60.0)
            model.apply(op)
    finally:
        backend.close()


# --------------------------------------------------------------------------- guards

# Up to 2**53: the Redis guard's Lua compares tokens as doubles (see test_guards.py).
tokens = st.lists(
    st.one_of(st.integers(min_value=0, max_value=12), st.integers(min_value=0, max_value=2**53)),
    min_size=1,
    max_size=30,
)


def _expected(seq: list[int]) -> list[bool]:
    """A token is accepted iff it is >= every token accepted before it."""
    best: int | None = None
    out = []
    for t in seq:
        ok = best is None or t >= best
        out.append(ok)
        if ok:
            best = t
    return out


@settings(max_examples=40, deadline=None)
@given(tokens)
def test_sql_guard_accepts_exactly_the_non_stale_tokens(seq: list[int]) -> None:
    engine = sa.create_engine("sqlite://")
    guard = SqlFenceGuard()
    guard.create_schema(engine)
    meta = sa.MetaData()
    writes = sa.Table(
        "writes",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("fence", sa.BigInteger, nullable=False),
    )
    meta.create_all(engine)
    accepted: list[bool] = []
    for t in seq:
        try:
            with guard.transaction(engine, "resource", t) as conn:
                conn.execute(writes.insert().values(fence=t))
            accepted.append(True)
        except StaleFence as exc:
            assert exc.last is not None and exc.last > t
            accepted.append(False)
    assert accepted == _expected(seq)
    with engine.connect() as conn:
        stored = list(conn.execute(sa.select(writes.c.fence).order_by(writes.c.id)).scalars())
        assert stored == [t for t, ok in zip(seq, accepted, strict=True) if ok]
        assert guard.last(conn, "resource") == max(stored)
    engine.dispose()


@SLOW
@given(tokens)
def test_redis_guard_accepts_exactly_the_non_stale_tokens(
    redis_server: RedisServer, seq: list[int]
) -> None:
    client: redis.Redis = redis_server.client()
    guard = RedisFenceGuard(client)
    resource = f"prop:{uuid.uuid4().hex}"
    log = f"{resource}:log"
    accepted = []
    for i, t in enumerate(seq):
        try:  # a write id per write: two writes under one fence are two distinct writes
            guard.write(resource, t, [("RPUSH", log, t)], write_id=str(i))
            accepted.append(True)
        except StaleFence:
            accepted.append(False)
    assert accepted == _expected(seq)
    stored = [int(x) for x in client.lrange(log, 0, -1)]
    assert stored == [t for t, ok in zip(seq, accepted, strict=True) if ok]
    assert guard.last(resource) == max(stored)
    client.close()
