"""Fence guards on real SQLite, PostgreSQL, MariaDB and Redis: equal in, lower out, races too."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from jobfence.locks import LockError, RedisFenceGuard, SqlFenceGuard, StaleFence
from tests.servers import wait_for

metadata = sa.MetaData()
effects = sa.Table(
    "guard_effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("resource", sa.String(255), nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)
guard = SqlFenceGuard()


@pytest.fixture(params=["sqlite_url", "pg_url", "mariadb_url"])
def engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    url: str = request.getfixturevalue(request.param)
    eng = sa.create_engine(url)
    metadata.create_all(eng)
    guard.create_schema(eng)
    yield eng
    eng.dispose()


def _resource() -> str:
    return f"res:{uuid.uuid4().hex[:12]}"


def _write(engine: sa.Engine, resource: str, fence: int) -> None:
    with guard.transaction(engine, resource, fence) as conn:
        conn.execute(effects.insert().values(resource=resource, fence=fence))


def _effects(engine: sa.Engine, resource: str) -> list[int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(effects.c.fence).where(effects.c.resource == resource).order_by(effects.c.id)
        )
        return [int(f) for f in rows.scalars()]


def _last(engine: sa.Engine, resource: str) -> int | None:
    with engine.connect() as conn:
        return guard.last(conn, resource)


# --------------------------------------------------------------------------- SQL, one writer


def test_equal_accepted_lower_refused(engine: sa.Engine) -> None:
    r = _resource()
    assert _last(engine, r) is None
    _write(engine, r, 5)
    _write(engine, r, 5)  # the same holder writing twice
    _write(engine, r, 1_795_271_197_229_967)  # a Redis-sized token
    with pytest.raises(StaleFence) as refused:
        _write(engine, r, 7)
    assert (refused.value.resource, refused.value.fence) == (r, 7)
    assert refused.value.last == 1_795_271_197_229_967
    assert _effects(engine, r) == [5, 5, 1_795_271_197_229_967]
    assert _last(engine, r) == 1_795_271_197_229_967


def test_stale_check_after_the_write_rolls_the_write_back(engine: sa.Engine) -> None:
    r = _resource()
    _write(engine, r, 10)
    with pytest.raises(StaleFence), engine.begin() as conn:
        conn.execute(effects.insert().values(resource=r, fence=3))  # written first ...
        guard.check_and_advance(conn, r, 3)  # ... checked second: the whole transaction fails
    assert _effects(engine, r) == [10]
    assert _last(engine, r) == 10


def test_resources_are_independent(engine: sa.Engine) -> None:
    a, b = _resource(), _resource()
    _write(engine, a, 100)
    _write(engine, b, 1)
    assert (_last(engine, a), _last(engine, b)) == (100, 1)


def test_bad_arguments_are_refused(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for resource, fence in [("", 1), ("x" * 256, 1), ("r", -1), ("r", True), ("r", "5")]:
            with pytest.raises(LockError):
                guard.check_and_advance(conn, resource, fence)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- SQL, concurrent


def _blocked_writers(engine: sa.Engine) -> int | None:
    """Writers of this database waiting on a row lock; None where that is not visible."""
    name = engine.dialect.name
    if name == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    elif name in ("mysql", "mariadb"):
        # INNODB_TRX is a cache that goes stale under frequent readers; the process list is
        # live. With the first writer idle, any fence statement in flight here is blocked.
        sql = (
            "SELECT count(*) FROM information_schema.PROCESSLIST WHERE DB = database() "
            "AND COMMAND = 'Query' AND INFO LIKE '%%jobfence_fences%%' AND ID <> CONNECTION_ID()"
        )
    else:
        return None
    with engine.connect() as conn:
        return int(conn.execute(sa.text(sql)).scalar_one())


@pytest.mark.parametrize(("first", "second"), [(5, 7), (7, 5), (6, 6)])
def test_concurrent_first_inserts_resolve(engine: sa.Engine, first: int, second: int) -> None:
    """Two transactions claim a new resource; the second waits on the first's uncommitted row."""
    r = _resource()
    outcome: list[Any] = []
    started = threading.Event()

    def second_writer() -> None:
        started.set()
        try:
            _write(engine, r, second)
            outcome.append("ok")
        except BaseException as exc:
            outcome.append(exc)

    with engine.connect() as conn:
        tx = conn.begin()
        guard.check_and_advance(conn, r, first)
        conn.execute(effects.insert().values(resource=r, fence=first))
        thread = threading.Thread(target=second_writer, daemon=True)
        thread.start()
        assert started.wait(5)
        if _blocked_writers(engine) is not None:
            wait_for(
                lambda: outcome or _blocked_writers(engine),
                timeout=10.0,
                message="the second writer neither blocked nor finished",
            )
        assert not outcome, f"the second writer did not wait for the first: {outcome}"
        tx.commit()
    thread.join(30)
    assert outcome, "the second writer hung"

    if second >= first:
        assert outcome == ["ok"]
        assert sorted(_effects(engine, r)) == sorted([first, second])
    else:
        assert isinstance(outcome[0], StaleFence), outcome[0]
        assert outcome[0].last == first
        assert _effects(engine, r) == [first]
    assert _last(engine, r) == max(first, second)


def _race(engine: sa.Engine, r: str, fences: list[int]) -> tuple[list[int], list[StaleFence]]:
    """Write `fences` to `r` from one thread each, all at once; return accepted and refused."""
    barrier = threading.Barrier(len(fences))
    accepted: list[int] = []
    refused: list[StaleFence] = []
    other: list[BaseException] = []

    def run(fence: int) -> None:
        try:
            barrier.wait(10)
            _write(engine, r, fence)
            accepted.append(fence)
        except StaleFence as exc:
            refused.append(exc)
        except BaseException as exc:
            other.append(exc)

    threads = [threading.Thread(target=run, args=(f,), daemon=True) for f in fences]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not other, other
    assert len(accepted) + len(refused) == len(fences)
    return accepted, refused


def test_racing_writers_never_leak_errors(engine: sa.Engine) -> None:
    """Eight transactions race to claim fresh resources: only StaleFence may come out."""
    for _ in range(4):
        r = _resource()
        fences = random.sample(range(1, 1000), 8)
        accepted, refused = _race(engine, r, fences)
        assert max(fences) in accepted
        assert sorted(_effects(engine, r)) == sorted(accepted)
        assert _last(engine, r) == max(fences)
        for exc in refused:
            assert exc.fence is not None and exc.last is not None
            assert exc.fence < exc.last


def test_simultaneous_first_claims_resolve(engine: sa.Engine) -> None:
    """Both transactions reach their first write of the fence row before either makes it.

    (On MySQL/MariaDB an UPDATE-then-INSERT guard deadlocks here: both UPDATEs miss and
    take gap locks, then each INSERT waits for the other's gap lock.)
    """
    r = _resource()
    barrier = threading.Barrier(2, timeout=10)
    results: dict[int, Any] = {}

    def claim(fence: int) -> None:
        try:
            with engine.connect() as conn:
                waited = False

                @sa.event.listens_for(conn, "before_cursor_execute")
                def meet(*args: Any) -> None:
                    nonlocal waited
                    statement = str(args[2]).lstrip().upper()
                    if not waited and statement.startswith("INSERT INTO JOBFENCE_FENCES"):
                        waited = True
                        barrier.wait()

                with conn.begin():
                    guard.check_and_advance(conn, r, fence)
                    conn.execute(effects.insert().values(resource=r, fence=fence))
            results[fence] = "ok"
        except BaseException as exc:
            results[fence] = exc

    threads = [threading.Thread(target=claim, args=(f,), daemon=True) for f in (5, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[7] == "ok", results
    assert results[5] == "ok" or isinstance(results[5], StaleFence), results
    accepted = sorted(f for f, v in results.items() if v == "ok")
    assert sorted(_effects(engine, r)) == accepted
    assert _last(engine, r) == 7


# --------------------------------------------------------------------------- Redis


def test_redis_guard_equal_accepted_lower_refused(redis_client: redis.Redis) -> None:
    g = RedisFenceGuard(redis_client)
    r = _resource()
    assert g.last(r) is None
    assert g.write(r, 5, [("SET", "rg:value", "five"), ("RPUSH", "rg:log", "5")]) == [b"OK", 1]
    g.write(r, 5, [("RPUSH", "rg:log", "5b")], write_id="second")  # a 2nd write, same holder
    g.write(r, 1_795_271_197_229_967, [("SET", "rg:value", "big"), ("RPUSH", "rg:log", "big")])
    with pytest.raises(StaleFence) as refused:
        g.write(r, 7, [("SET", "rg:value", "stale"), ("RPUSH", "rg:log", "7")])
    assert refused.value.last == 1_795_271_197_229_967
    assert redis_client.get("rg:value") == b"big"
    assert redis_client.lrange("rg:log", 0, -1) == [b"5", b"5b", b"big"]
    assert g.last(r) == 1_795_271_197_229_967
    with pytest.raises(LockError):
        g.write(r, -1, [("SET", "rg:value", "x")])


def test_redis_guard_exact_above_2_pow_53(redis_client: redis.Redis) -> None:
    g = RedisFenceGuard(redis_client)
    r = _resource()
    g.write(r, 2**53 + 1, [("SET", "rg:big", "new")])
    with pytest.raises(StaleFence):
        g.write(r, 2**53, [("SET", "rg:big", "stale")])
    assert redis_client.get("rg:big") == b"new"
