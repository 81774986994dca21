"""jobfence's tables appear on first use: idempotent, cached per engine, safe when workers race."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from jobfence.locks import SqlFenceGuard
from jobfence.locks.sql import SchemaError, ensure_tables
from jobfence.tasks import SqlEffects, make_engine
from jobfence.tasks.effects import TABLES
from tests.conftest import scratch_database_url
from tests.servers import (
    MARIADB_ADMIN_URL,
    POSTGRES_ADMIN_URL,
    MariaDBDatabase,
    PostgresDatabase,
    unique_name,
)
from tests.tasks.conftest import job_with_fence as job

NAMES = {t.name for t in TABLES}
RACERS = 8



def tables_in(url: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        return set(sa.inspect(engine).get_table_names()) & NAMES
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each kind, private to this test."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.sqlite'}"
        return
    kind, admin = {
        "postgresql": (PostgresDatabase, POSTGRES_ADMIN_URL),
        "mariadb": (MariaDBDatabase, MARIADB_ADMIN_URL),
    }[request.param]
    yield from scratch_database_url(kind, admin)


@pytest.fixture
def engine(fresh_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(fresh_url)
    yield engine
    engine.dispose()


def count_statements(engine: sa.Engine) -> list[str]:
    seen: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    return seen


def test_the_first_effect_creates_the_tables(engine: sa.Engine, fresh_url: str) -> None:
    assert tables_in(fresh_url) == set()
    effects = SqlEffects(engine)
    with effects.transaction(job("first", 5), "job:first") as tx:
        tx.result = {"ok": True}
    assert tables_in(fresh_url) == NAMES
    assert effects.record("first") is not None


def test_the_guard_alone_creates_its_table(engine: sa.Engine, fresh_url: str) -> None:
    guard = SqlFenceGuard()
    with guard.transaction(engine, "acct:1", 7):
        pass
    assert tables_in(fresh_url) == {"jobfence_fences"}
    with engine.connect() as conn:
        assert guard.last(conn, "acct:1") == 7


def test_check_and_advance_inside_the_callers_transaction(
    engine: sa.Engine, fresh_url: str
) -> None:
    # The user's own transaction is open when the guard first meets the database.
    guard = SqlFenceGuard()
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT 1"))
        guard.check_and_advance(conn, "acct:2", 3)
    with engine.connect() as conn:
        assert guard.last(conn, "acct:2") == 3


def test_a_rolled_back_first_transaction_leaves_the_next_one_working(
    engine: sa.Engine, fresh_url: str
) -> None:
    # On SQLite the table is created inside the caller's transaction: a rollback takes it
    # away again, so it must not be remembered as present.
    guard = SqlFenceGuard()
    with pytest.raises(RuntimeError), engine.begin() as conn:
        guard.check_and_advance(conn, "acct:3", 3)
        raise RuntimeError("the caller's body failed")
    with engine.begin() as conn:
        guard.check_and_advance(conn, "acct:3", 4)
    with engine.connect() as conn:
        assert guard.last(conn, "acct:3") == 4


def test_the_catalog_is_read_once_per_engine(engine: sa.Engine) -> None:
    effects = SqlEffects(engine)
    with effects.transaction(job("a", 1), "job:a") as tx:
        tx.result = 1
    seen = count_statements(engine)
    for i in range(3):
        with effects.transaction(job(f"b{i}", 2), f"job:b{i}") as tx:
            tx.result = i
    catalog = [s for s in seen if "CREATE" in s.upper() or "information_schema" in s
               or "sqlite_master" in s or "pg_catalog" in s or "pg_class" in s]  # fmt: skip
    assert catalog == [], catalog
    assert len(seen) > 0


def test_create_schema_is_idempotent_and_says_what_it_created(engine: sa.Engine) -> None:
    effects = SqlEffects(engine)
    assert sorted(effects.create_schema()) == sorted(NAMES)
    assert effects.create_schema() == []
    fresh_engine = make_engine(engine.url.render_as_string(hide_password=False))
    try:
        assert SqlEffects(fresh_engine).create_schema() == []
    finally:
        fresh_engine.dispose()


@pytest.fixture
def pg_fresh_url() -> Iterator[str]:
    if (reason := PostgresDatabase.reachable(POSTGRES_ADMIN_URL)) is not None:
        pytest.skip(reason)
    with PostgresDatabase() as db:
        yield db.url


def test_existing_tables_need_no_create_privilege(pg_fresh_url: str) -> None:
    # A DBA made the tables; the workers' role may only read and write them.
    owner = make_engine(pg_fresh_url)
    SqlEffects(owner).create_schema()
    role = unique_name("jf_rw")
    with owner.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(sa.text(f"GRANT SELECT, INSERT, UPDATE ON {', '.join(NAMES)} TO {role}"))
        conn.execute(sa.text(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {role}"))
    worker = make_engine(sa.make_url(pg_fresh_url).set(username=role).render_as_string(False))
    try:
        with SqlEffects(worker).transaction(job("ro", 1), "job:ro") as tx:
            tx.result = "ok"
    finally:
        worker.dispose()
        with owner.begin() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))
        owner.dispose()


def test_missing_tables_without_privilege_name_the_fix(pg_fresh_url: str) -> None:
    owner = make_engine(pg_fresh_url)
    role = unique_name("jf_np")
    with owner.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(sa.text(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {role}"))
    url = sa.make_url(pg_fresh_url).set(username=role).render_as_string(False)
    worker = make_engine(url)
    try:
        with pytest.raises(SchemaError) as caught:
            ensure_tables(worker, TABLES)
        message = str(caught.value)
        assert "jobfence migrate" in message and "jobfence_fences" in message
        assert role not in message and "@" not in message  # no URL, no user in the error
    finally:
        worker.dispose()
        with owner.begin() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))
        owner.dispose()


# -- many workers starting at once ---------------------------------------------------------


def first_task(url: str, index: int, start: Any, results: Any) -> None:
    """One freshly started worker: its first job, at the same moment as every other."""
    try:
        engine = make_engine(url)
        with engine.connect():
            pass  # connected before the start line: the race is on the DDL alone
        start.wait(60)
        with SqlEffects(engine).transaction(job(f"job-{index}", index + 1), f"r:{index}") as tx:
            tx.result = index
        engine.dispose()
        results.put((index, "ok"))
    except BaseException:
        results.put((index, traceback.format_exc()))


def naive_first_task(url: str, index: int, start: Any, results: Any) -> None:
    """Control: check, then create, as `metadata.create_all` does; every worker checks first."""
    try:
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        with engine.begin() as conn:
            missing = [t for t in TABLES if not sa.inspect(conn).has_table(t.name)]
            start.wait(60)  # every racer has seen the tables missing
            for table in missing:
                table.create(conn, checkfirst=False)
        engine.dispose()
        results.put((index, "ok"))
    except BaseException:
        results.put((index, traceback.format_exc()))


def race(url: str, target: Any) -> dict[int, str]:
    # Forked before any engine exists: each racer builds its own, as a fresh worker does.
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(RACERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(url, i, start, results)) for i in range(RACERS)]
    for p in procs:
        p.start()
    outcome = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return outcome


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_workers_starting_at_once_all_run_their_first_job(kind: str) -> None:
    db_class, admin = {
        "postgresql": (PostgresDatabase, POSTGRES_ADMIN_URL),
        "mariadb": (MariaDBDatabase, MARIADB_ADMIN_URL),
    }[kind]
    if (reason := db_class.reachable(admin)) is not None:
        pytest.skip(reason)
    with db_class() as naive_db, db_class() as db:
        control = race(naive_db.url, naive_first_task)
        failed = {i: err for i, err in control.items() if err != "ok"}
        assert len(failed) == RACERS - 1, f"the naive check-then-create should collide: {control}"
        assert any("exist" in err or "duplicate" in err.lower() for err in failed.values())

        outcome = race(db.url, first_task)
        assert outcome == {i: "ok" for i in range(RACERS)}, outcome
        engine = sa.create_engine(db.url, poolclass=sa.NullPool)
        try:
            with engine.connect() as conn:
                done = conn.execute(sa.text("SELECT count(*) FROM jobfence_jobs")).scalar_one()
        finally:
            engine.dispose()
        assert done == RACERS


# -- engines across fork -------------------------------------------------------------------


def session_in_child(engine: sa.Engine, out: Any) -> None:
    """Forked child: how many parent connections its pool holds, and the session it gets."""
    try:
        idle = engine.pool.checkedin()  # type: ignore[attr-defined]
        with engine.connect() as conn:
            out.put((idle, conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()))
    except BaseException:
        out.put((-1, traceback.format_exc()))


@pytest.mark.parametrize("registered", [True, False], ids=["jobfence", "plain-control"])
def test_a_forked_child_never_gets_the_parents_pooled_connection(
    pg_url: str, registered: bool
) -> None:
    engine = make_engine(pg_url) if registered else sa.create_engine(pg_url, pool_pre_ping=True)
    try:
        with engine.connect() as conn:  # the parent touches the database: one idle connection
            parent = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=session_in_child, args=(engine, out))
        child.start()
        idle, session = out.get(timeout=60)
        child.join(30)
        if registered:
            assert (idle, session != parent) == (0, True), session
        else:  # control: the plain engine hands the child the parent's own session
            assert (idle, session) == (1, parent)
        with engine.connect() as conn:  # and the parent's connection still works
            assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() == parent
    finally:
        engine.dispose()


def test_an_in_memory_sqlite_database_survives_into_a_forked_child() -> None:
    engine = make_engine("sqlite://")
    try:
        SqlEffects(engine).create_schema()
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()

        def child() -> None:
            out.put(sorted(sa.inspect(engine).get_table_names()))

        proc = ctx.Process(target=child)
        proc.start()
        assert out.get(timeout=60) == sorted(NAMES)
        proc.join(30)
    finally:
        engine.dispose()
