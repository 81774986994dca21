"""Advisory transaction locks on real PostgreSQL and MariaDB: exclusion, fences, release, keys."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from multiprocessing.synchronize import Event as EventType
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from jobfence.locks import (
    AcquireTimeout,
    LockError,
    RedisBackend,
    RedisFenceGuard,
    SqlFenceGuard,
    advisory,
)
from jobfence.locks.errors import StaleFence
from jobfence.locks.guards import fences
from tests.servers import ProcessGroup, wait_for

counter_meta = sa.MetaData()
counters = sa.Table(
    "advisory_counters",
    counter_meta,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("n", sa.Integer, nullable=False),
)
HOLDERS = 4
ROUNDS = 5
SECTION_S = 0.02  # between the read and the write of the counter: a naive writer loses updates


@pytest.fixture(params=["pg_url", "mariadb_url"])
def db_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(db_url)
    counter_meta.create_all(eng)
    SqlFenceGuard().create_schema(eng)
    yield eng
    eng.dispose()


def _key() -> str:
    return f"stock/sku-{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------- hashing


def test_key_hashes_are_stable_and_never_show_the_key() -> None:
    key = "payments/customer 42 card=4111"
    assert advisory.advisory_id(key) == advisory.advisory_id(key)
    assert advisory.advisory_id("a") == -3848465438864589366  # pinned: sha256 "ca978112ca1bbdca…"
    assert -(2**63) <= advisory.advisory_id(key) < 2**63
    name = advisory.lock_name(key, "shop")
    assert len(name) <= 64 and "4111" not in name and "customer" not in name
    assert name == advisory.lock_name(key, "shop") != advisory.lock_name(key, "other")
    resource = advisory.fence_resource(key)
    assert len(resource) <= 255 and "4111" not in resource
    with pytest.raises(LockError, match="non-empty string"):
        advisory.advisory_id("")


def test_fence_row_holds_the_hash_not_the_key(engine: sa.Engine) -> None:
    key = f"secret-{uuid.uuid4().hex}"
    with engine.begin() as conn, advisory.transaction_lock(conn, key):
        pass
    with engine.connect() as conn:
        rows = conn.execute(sa.select(fences.c.resource)).scalars().all()
    assert advisory.fence_resource(key) in rows
    assert not [r for r in rows if key in r]


# --------------------------------------------------------------------------- exclusion


def _holder(url: str, key: str, use_lock: bool, go: EventType, out: Any) -> None:
    """One racing process: ROUNDS read-modify-writes of one counter, stamped."""
    eng = sa.create_engine(url, poolclass=NullPool)
    go.wait(30)
    try:
        for _ in range(ROUNDS):
            with eng.begin() as conn:
                lock = (
                    advisory.transaction_lock(conn, key, timeout=30)
                    if use_lock
                    else contextlib.nullcontext(0)
                )
                with lock as fence:
                    start = time.monotonic_ns()
                    row = sa.select(counters.c.n).where(counters.c.name == key)
                    n = conn.execute(row).scalar_one()
                    time.sleep(SECTION_S)
                    conn.execute(counters.update().where(counters.c.name == key).values(n=n + 1))
                    end = time.monotonic_ns()
            # Recorded after the commit: a grant's fence is only real once committed.
            out.put((start, end, fence))
    finally:
        eng.dispose()


def _race(engine: sa.Engine, url: str, *, use_lock: bool) -> tuple[list[tuple[int, int, int]], int]:
    key = _key()
    with engine.begin() as conn:
        conn.execute(counters.insert().values(name=key, n=0))
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_holder, args=(url, key, use_lock, go, out)) for _ in range(HOLDERS)
    ]
    for p in procs:
        p.start()
    go.set()
    stamps = [out.get(timeout=60) for _ in range(HOLDERS * ROUNDS)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    with engine.connect() as conn:
        n = conn.execute(sa.select(counters.c.n).where(counters.c.name == key)).scalar_one()
    return sorted(stamps), int(n)


def test_processes_never_overlap_and_fences_increase_in_hold_order(
    engine: sa.Engine, db_url: str
) -> None:
    stamps, n = _race(engine, db_url, use_lock=True)
    for (_, end, fence), (start, _, next_fence) in itertools.pairwise(stamps):
        assert end <= start, "two processes held the advisory lock at once"
        assert next_fence > fence
    assert n == HOLDERS * ROUNDS
    assert stamps[0][2] >= 1_600_000_000 * 10**6  # the one fence space: server µs or more


def test_control_without_the_lock_the_same_race_loses_updates(
    engine: sa.Engine, db_url: str
) -> None:
    stamps, n = _race(engine, db_url, use_lock=False)
    overlaps = sum(e > s for (_, e, _), (s, _, _) in itertools.pairwise(stamps))
    assert overlaps and n < HOLDERS * ROUNDS


def test_a_grant_is_at_least_the_server_clock_in_microseconds(engine: sa.Engine) -> None:
    now_us = (
        "SELECT CAST(extract(epoch from clock_timestamp()) * 1000000 AS bigint)"
        if engine.dialect.name == "postgresql"
        else "SELECT CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)"
    )
    key = _key()
    with engine.connect() as conn:
        before = int(conn.execute(sa.text(now_us)).scalar_one())
    with engine.begin() as conn, advisory.transaction_lock(conn, key) as fence:
        pass
    with engine.connect() as conn:
        after = int(conn.execute(sa.text(now_us)).scalar_one())
    assert before <= fence <= after


# --------------------------------------------------------------------------- release


def test_a_rollback_releases_the_lock(engine: sa.Engine) -> None:
    key = _key()
    with (
        pytest.raises(RuntimeError),
        engine.begin() as conn,
        advisory.transaction_lock(conn, key),
    ):
        raise RuntimeError("body failed")
    with engine.begin() as other, advisory.try_transaction_lock(other, key) as fence:
        assert fence is not None


def test_the_lock_lasts_until_the_commit_not_the_block(engine: sa.Engine) -> None:
    key = _key()
    holder = engine.connect()
    try:
        tx = holder.begin()
        with advisory.transaction_lock(holder, key) as first:
            pass
        with engine.begin() as other, advisory.try_transaction_lock(other, key) as busy:
            assert busy is None  # the effect is not committed yet: still held
        tx.commit()
    finally:
        holder.close()
    with engine.begin() as other, advisory.try_transaction_lock(other, key) as fence:
        assert fence is not None and fence > first


def test_a_timeout_raises_and_leaves_the_transaction_usable(engine: sa.Engine) -> None:
    key = _key()
    with (
        engine.begin() as holder,
        advisory.transaction_lock(holder, key),
        engine.begin() as waiter,
    ):
        began = time.monotonic()
        with pytest.raises(AcquireTimeout), advisory.transaction_lock(waiter, key, timeout=0.2):
            pass
        assert 0.15 < time.monotonic() - began < 10
        assert waiter.execute(sa.text("SELECT 1")).scalar_one() == 1


def test_refuses_a_connection_outside_a_transaction_and_a_bad_timeout(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        with (
            pytest.raises(LockError, match="in a transaction"),
            advisory.transaction_lock(conn, _key()),
        ):
            pass
        conn.begin()
        with (
            pytest.raises(LockError, match="timeout"),
            advisory.transaction_lock(conn, _key(), timeout=-1),
        ):
            pass


def test_postgres_refuses_a_snapshot_taken_before_the_lock(pg_url: str) -> None:
    eng = sa.create_engine(pg_url, isolation_level="REPEATABLE READ")
    try:
        with (
            eng.begin() as conn,
            pytest.raises(LockError, match="READ COMMITTED"),
            advisory.transaction_lock(conn, _key()),
        ):
            pass
    finally:
        eng.dispose()


# --------------------------------------------------------------------------- one fence space


def test_a_guard_keeps_accepting_across_a_move_between_redis_and_sql(
    engine: sa.Engine, redis_url: str
) -> None:
    """Redis -> advisory (SQL fence row) -> Redis: each source's fences are above the last."""
    key, guard = _key(), SqlFenceGuard()
    backend = RedisBackend.from_url(redis_url)
    redis_guard = RedisFenceGuard(backend.client)
    try:
        accepted = []
        for source in ("redis", "sql", "redis", "sql"):
            if source == "redis":
                lease = backend.try_acquire(key, 5.0)
                assert lease is not None
                fence = lease.fence
                lease.release()
            else:
                with engine.begin() as conn, advisory.transaction_lock(conn, key) as fence:
                    pass
            with guard.transaction(engine, key, fence):
                pass  # raises StaleFence if the move went down
            redis_guard.write(key, fence, [])
            accepted.append(fence)
        assert accepted == sorted(accepted) and len(set(accepted)) == 4
        # Control: a counter that starts at 1 (the seed's sequence) is refused after the move.
        with pytest.raises(StaleFence), guard.transaction(engine, key, 1):
            pass
    finally:
        backend.close()


# --------------------------------------------------------------------------- session locks fail


HOLDER_SCRIPT = """
import sys, time
import sqlalchemy as sa
from jobfence.locks import RedisBackend
pg_url, redis_url, key, lock_id = sys.argv[1:5]
lease = RedisBackend.from_url(redis_url).try_acquire(key, 1.0)
conn = sa.create_engine(pg_url).connect()
conn.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": int(lock_id)})
conn.commit()
print("held", lease.fence, flush=True)
time.sleep(600)
"""


def test_a_frozen_holder_keeps_a_session_advisory_lock_while_its_lease_expires(
    pg_url: str, redis_url: str, process_group: ProcessGroup
) -> None:
    """Why the session lock is not the job lease: SIGSTOP the holder of both."""
    key = _key()
    lock_id = advisory.advisory_id(key)
    holder = process_group.spawn(
        [sys.executable, "-c", HOLDER_SCRIPT, pg_url, redis_url, key, str(lock_id)],
        name="session-holder",
    )
    wait_for(lambda: "held" in process_group.log_of(holder), 30, 0.05,
             lambda: process_group.log_of(holder))  # fmt: skip
    old_fence = int(process_group.log_of(holder).split("held", 1)[1].split()[0])
    os.kill(holder.pid, signal.SIGSTOP)
    eng = sa.create_engine(pg_url, poolclass=NullPool)
    backend = RedisBackend.from_url(redis_url)
    try:

        def session_lock_free() -> bool:
            with eng.connect() as conn:
                got = conn.execute(sa.text("SELECT pg_try_advisory_lock(:id)"), {"id": lock_id})
                if got.scalar_one():
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": lock_id})
                    return True
                return False

        lease = wait_for(lambda: backend.try_acquire(key, 5.0), 15, 0.05, "lease never expired")
        assert (
            lease.fence > old_fence
        )  # the lease moved on, with a fence that fences the old holder
        frozen_for = time.monotonic()
        while time.monotonic() - frozen_for < 2.0:  # twice the lease's TTL past its expiry
            assert not session_lock_free(), "the session lock was released"
            time.sleep(0.2)
        lease.release()
        # Only the end of the frozen holder's session frees it.
        os.kill(holder.pid, signal.SIGCONT)
        process_group.stop(holder)
        wait_for(session_lock_free, 15, 0.05, "the session lock outlived its session")
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
        backend.close()
        eng.dispose()


GET_LOCK_HOLDER = """
import sys, time
import sqlalchemy as sa
url, name = sys.argv[1:3]
conn = sa.create_engine(url).connect()
got = conn.execute(sa.text("SELECT GET_LOCK(:n, 0)"), {"n": name}).scalar_one()
conn.commit()
print("held", got, conn.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one(), flush=True)
time.sleep(600)
"""


def test_a_dropped_session_hands_get_lock_to_another_behind_a_frozen_holder(
    mariadb_url: str, process_group: ProcessGroup
) -> None:
    """The other failure of a session lock: the server ends a frozen holder's session (here
    KILL, as `wait_timeout` or a keepalive would) and grants the lock again while the holder,
    never told, still believes it holds it. Nothing fences the holder's next write."""
    name = advisory.lock_name(_key(), "test")
    holder = process_group.spawn(
        [sys.executable, "-c", GET_LOCK_HOLDER, mariadb_url, name], name="get-lock-holder"
    )
    wait_for(lambda: "held" in process_group.log_of(holder), 30, 0.05,
             lambda: process_group.log_of(holder))  # fmt: skip
    got, connection_id = process_group.log_of(holder).split("held", 1)[1].split()[:2]
    assert got == "1"
    os.kill(holder.pid, signal.SIGSTOP)
    eng = sa.create_engine(mariadb_url, poolclass=NullPool)
    try:
        with eng.connect() as contender:
            take = sa.text("SELECT GET_LOCK(:n, 0)")
            assert contender.execute(take, {"n": name}).scalar_one() == 0  # control: it is held
            with eng.connect() as admin:
                admin.execute(sa.text(f"KILL {int(connection_id)}"))
            granted = wait_for(
                lambda: contender.execute(take, {"n": name}).scalar_one() == 1, 10, 0.05,
                "GET_LOCK was not granted after the holder's session ended",
            )  # fmt: skip
            assert granted and holder.poll() is None  # the holder lives on, frozen, unaware
            contender.execute(sa.text("SELECT RELEASE_LOCK(:n)"), {"n": name})
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        eng.dispose()
