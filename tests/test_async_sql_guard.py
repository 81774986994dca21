"""AsyncSqlFenceGuard on the real PostgreSQL: fenced writes, stale refusals, one fence row shared
with the sync guard, and a SIGSTOPped asyncio holder's late write refused."""

from __future__ import annotations

import asyncio
import textwrap
import uuid

import pytest
import sqlalchemy as sa

from jobfence import AsyncLocker, AsyncSqlFenceGuard, SqlFenceGuard, StaleFence
from tests.frozen import frozen_holder

pytest.importorskip("greenlet", reason="SQLAlchemy's asyncio needs it: jobfence[asyncio-sql]")
from sqlalchemy.ext.asyncio import create_async_engine


def _resource() -> str:
    return f"acct-{uuid.uuid4().hex[:8]}"


def test_current_fence_writes_and_a_stale_one_is_refused(pg_url: str) -> None:
    resource = _resource()

    async def main() -> None:
        engine = create_async_engine(pg_url)
        guard = AsyncSqlFenceGuard()
        await guard.create_schema(engine)
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE IF NOT EXISTS aguard_rows (k text, v text)"))
        async with guard.transaction(engine, resource, 5) as conn:
            await conn.execute(sa.text("INSERT INTO aguard_rows VALUES (:k, 'five')"),
                               {"k": resource})  # fmt: skip
        async with guard.transaction(engine, resource, 5):  # the same fence again: accepted
            pass
        with pytest.raises(StaleFence) as refused:
            async with guard.transaction(engine, resource, 4) as conn:
                await conn.execute(sa.text("INSERT INTO aguard_rows VALUES (:k, 'four')"),
                                   {"k": resource})  # fmt: skip
        assert refused.value.last == 5
        async with engine.connect() as conn:
            assert await guard.last(conn, resource) == 5
            rows = await conn.execute(sa.text("SELECT v FROM aguard_rows WHERE k = :k"),
                                      {"k": resource})  # fmt: skip
            assert [r[0] for r in rows] == ["five"]  # the stale write rolled back
        await engine.dispose()

    asyncio.run(main())


def test_sync_and_async_guards_share_the_fence_row(pg_url: str) -> None:
    resource = _resource()
    sync_engine = sa.create_engine(pg_url)
    sync_guard = SqlFenceGuard()
    with sync_guard.transaction(sync_engine, resource, 10):
        pass

    async def main() -> None:
        engine = create_async_engine(pg_url)
        guard = AsyncSqlFenceGuard()
        with pytest.raises(StaleFence):
            async with guard.transaction(engine, resource, 9):
                pass
        async with guard.transaction(engine, resource, 11):
            pass
        await engine.dispose()

    asyncio.run(main())
    with pytest.raises(StaleFence) as refused, sync_guard.transaction(sync_engine, resource, 10):
        pass
    assert refused.value.last == 11
    sync_engine.dispose()


FROZEN_HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine
    from jobfence import AsyncLocker, AsyncSqlFenceGuard, StaleFence
    from jobfence.locks import LeaseLost

    async def main(url, resource):
        locker = AsyncLocker.from_url(url)
        engine = create_async_engine(url)
        guard = AsyncSqlFenceGuard()
        async with locker.lock(resource, ttl=1.0) as lease:
            print("HELD", lease.fence, flush=True)
            sys.stdin.readline()  # the parent SIGSTOPs us here, and lets us go on later
            try:
                async with guard.transaction(engine, resource, lease.fence) as conn:
                    await conn.execute(sa.text("UPDATE aguard_balance SET v = 'stale' "
                                               "WHERE k = :k"), {"k": resource})
                print("WROTE", flush=True)
            except StaleFence:
                print("REFUSED", flush=True)

    try:
        asyncio.run(main(sys.argv[1], sys.argv[2]))
    except LeaseLost:  # at the block's exit: the lease was lost while it ran (the point)
        pass
    """
)


@pytest.mark.parametrize("guarded", [True, False], ids=["fenced", "naive-control"])
def test_sigstopped_async_holder_late_write_is_refused_on_postgres(
    pg_url: str, guarded: bool
) -> None:
    """Locks and fences on PostgreSQL (AsyncLocker's native store, AsyncSqlFenceGuard): the
    holder freezes past its TTL, a newer holder writes, the frozen one wakes and writes late.
    Fenced: refused. The control (the same UPDATE with no fence check) overwrites."""
    resource = _resource()
    sync_engine = sa.create_engine(pg_url)
    with sync_engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS aguard_balance (k text, v text)"))
        conn.execute(sa.text("INSERT INTO aguard_balance VALUES (:k, 'initial')"), {"k": resource})
    script = FROZEN_HOLDER if guarded else FROZEN_HOLDER.replace(
        "guard.transaction(engine, resource, lease.fence)", "engine.begin()"
    )  # fmt: skip
    try:
        with frozen_holder(script, pg_url, resource) as holder:

            async def newer() -> int:
                locker = AsyncLocker.from_url(pg_url)
                engine = create_async_engine(pg_url)
                async with locker.lock(resource, ttl=10, timeout=30) as lease:  # after the TTL
                    async with AsyncSqlFenceGuard().transaction(engine, resource,
                                                                lease.fence) as c:  # fmt: skip
                        await c.execute(
                            sa.text("UPDATE aguard_balance SET v = 'new' WHERE k = :k"),
                            {"k": resource},
                        )
                    fence = lease.fence
                await engine.dispose()
                await locker.aclose()
                return fence

            assert asyncio.run(newer()) > holder.fence
            verdict = holder.thaw()
        with sync_engine.connect() as conn:
            value = conn.execute(sa.text("SELECT v FROM aguard_balance WHERE k = :k"),
                                 {"k": resource}).scalar_one()  # fmt: skip
        if guarded:
            assert (verdict, value) == ("REFUSED", "new")
        else:
            assert (verdict, value) == ("WROTE", "stale")  # the lost update a fence prevents
    finally:
        sync_engine.dispose()


@pytest.mark.fault
def test_a_connection_killed_inside_the_async_guard_transaction_is_outcome_unknown(
    pg_url: str,
) -> None:
    """The session is killed just before the body's insert: nothing committed, and the job is
    told to come back (CommitOutcomeUnknown), never a plain database error read as failure."""
    from jobfence.locks import CommitOutcomeUnknown
    from tests.pg_cut import kill_session_at

    resource = _resource()
    admin = sa.create_engine(pg_url)

    async def main() -> None:
        engine = create_async_engine(pg_url)
        guard = AsyncSqlFenceGuard()
        await guard.create_schema(engine)
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE IF NOT EXISTS aguard_rows (k text, v text)"))
        fired = kill_session_at(engine.sync_engine, admin, "INSERT INTO aguard_rows")
        with pytest.raises(CommitOutcomeUnknown, match="nothing committed"):
            async with guard.transaction(engine, resource, 5) as conn:
                await conn.execute(sa.text("INSERT INTO aguard_rows VALUES (:k, 'lost')"),
                                   {"k": resource})  # fmt: skip
        assert fired.is_set()
        async with guard.transaction(engine, resource, 6) as conn:  # delivered again: once
            await conn.execute(sa.text("INSERT INTO aguard_rows VALUES (:k, 'six')"),
                               {"k": resource})  # fmt: skip
        async with engine.connect() as conn:
            rows = await conn.execute(sa.text("SELECT v FROM aguard_rows WHERE k = :k"),
                                      {"k": resource})  # fmt: skip
            assert [r[0] for r in rows] == ["six"]
        await engine.dispose()

    try:
        asyncio.run(main())
    finally:
        admin.dispose()
