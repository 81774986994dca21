"""PostgreSQL behind PgBouncer in transaction pooling: the lock URL and the ledger URL hold.

The lock contract runs through a private PgBouncer too (`pgbouncer` in
tests/contract/conftest.py). Here: a duplicate storm through it (forked processes racing
on the same jobs, the job's begin, its effect in the ledger and its commit all through the
pooler) runs each job once; the control forces prepared statements through the same
pooler, as the backend did before, and breaks. And what cannot work is refused with the fix.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from jobfence.locks import BackendUnavailable, Busy, JobRecord
from jobfence.locks.backends import postgres
from jobfence.locks.backends.postgres import connection as pg_connection
from jobfence.tasks import JobContext, SqlEffects, make_engine
from tests.servers import PgBouncer, PostgresDatabase, wait_for
from tests.test_postgres_backend import _startup_findings

pytestmark = [pytest.mark.fault, pytest.mark.slow]

PROCESSES = 12
JOBS = 100
TTL = 3.0  # a holder whose commit failed loses its lease this soon: its job runs again

ledger_meta = sa.MetaData()
ledger = sa.Table(
    "storm_ledger", ledger_meta, sa.Column("job_key", sa.String(255), nullable=False)
)


@pytest.fixture
def bouncer() -> Iterator[PgBouncer]:
    from devstack.local_pgbouncer import unavailable

    reason = unavailable() or PostgresDatabase.reachable(PostgresDatabase.default_admin_url)
    if reason is not None:
        pytest.skip(reason)
    with PgBouncer(pool_size=3) as started:  # fewer server sessions than racers
        yield started


@pytest.fixture
def database(bouncer: PgBouncer) -> Iterator[PostgresDatabase]:
    with PostgresDatabase() as db:
        engine = db.engine()
        try:
            ledger_meta.create_all(engine)
        finally:
            engine.dispose()
        yield db


def _job(backend: postgres.PostgresBackend, effects: SqlEffects, key: str, runs: Path) -> None:
    """Deliver `key`'s job until it is done, as the executor does: a grant runs the body
    (noted in `runs`) and its effect, then commits; an error delivers it again."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            got = backend.begin(key, TTL, record=True, fingerprint="fp")
            if isinstance(got, Busy):
                backend.wait_for_release(key, 0.5)
                continue
        except BackendUnavailable:
            continue
        if isinstance(got, JobRecord):
            return
        with open(runs, "a") as notes:  # O_APPEND: one whole line per run
            notes.write(f"{key}\n")
        try:
            with effects.transaction(JobContext(key=key, fingerprint="fp", lease=got)) as tx:
                if not tx.done:
                    tx.conn.execute(ledger.insert().values(job_key=key))
                    tx.result = 1
            if backend.commit(got, state="DONE", result="1", fingerprint="fp", result_ttl=600):
                return
        except (BackendUnavailable, sa.exc.DBAPIError) as exc:
            with open(f"{runs}.errors", "a") as notes:  # what the control looks for
                notes.write("prepared\n" if "prepared statement" in str(exc) else "other\n")
            time.sleep(0.01)  # delivered again
    raise RuntimeError(f"{key} not done in 120 s")


def _racer(
    lock_url: str, db_url: str, runs: str, prepare: bool, jobs: int, go: Any, out: Any
) -> None:
    try:
        if prepare:  # the control: the backend as it was, preparing through the pooler
            pg_connection.behind_pooler = lambda conn: False  # type: ignore[assignment]
        backend = postgres.PostgresBackend.from_url(lock_url, prefix="storm", socket_timeout=5)
        effects = SqlEffects(make_engine(db_url, connect_args={} if not prepare else
                                         {"prepare_threshold": 5}))  # fmt: skip
        keys = [f"storm:{i}" for i in range(jobs)]
        random.shuffle(keys)
        if not go.wait(30):
            raise RuntimeError("start signal never came")
        for key in keys:
            _job(backend, effects, key, Path(runs))
        out.put(("done", os.getpid(), backend.pooled))
    except BaseException as exc:
        out.put(("error", os.getpid(), repr(exc)))


def _storm(
    bouncer: PgBouncer,
    db: PostgresDatabase,
    runs: Path,
    *,
    prepare: bool,
    jobs: int = JOBS,
    until: Callable[[], bool] | None = None,
) -> list[Any]:
    """Every racer delivers every job; what each racer said at the end. With `until`, the
    storm ends as soon as it holds (the racers are killed), or after 300 s."""
    url = bouncer.url_for(db.name)
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    racers = [
        ctx.Process(target=_racer, args=(url, url, str(runs), prepare, jobs, go, out), daemon=True)
        for _ in range(PROCESSES)
    ]
    try:
        for p in racers:
            p.start()
        go.set()
        if until is not None:
            wait_for(until, timeout=300, interval=0.1, message="the storm never showed it")
            return []
        said = [out.get(timeout=300) for _ in racers]
        for p in racers:
            p.join(10)
    finally:
        for p in racers:
            if p.is_alive():
                p.kill()
                p.join(5)
    return said


def _ledger(db: PostgresDatabase) -> Counter[str]:
    engine = db.engine()
    try:
        with engine.connect() as conn:
            return Counter(conn.execute(sa.select(ledger.c.job_key)).scalars())
    finally:
        engine.dispose()


def test_a_duplicate_storm_through_pgbouncer_runs_each_job_once(
    bouncer: PgBouncer, database: PostgresDatabase, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    runs.touch()
    said = _storm(bouncer, database, runs, prepare=False)

    assert [s[0] for s in said] == ["done"] * PROCESSES, said
    assert all(s[2] is True for s in said), "the backend did not see the pooler"
    ran = Counter(runs.read_text().split())
    assert len(ran) == JOBS and set(ran.values()) == {1}, {k: n for k, n in ran.items() if n > 1}
    errors = Path(f"{runs}.errors")
    assert "prepared" not in (errors.read_text().split() if errors.exists() else [])
    assert set(_ledger(database).values()) == {1} and len(_ledger(database)) == JOBS


def test_control_prepared_statements_through_pgbouncer_break_the_storm(
    bouncer: PgBouncer, database: PostgresDatabase, tmp_path: Path
) -> None:
    """The same storm with statements prepared (the backend before the fix, psycopg's own
    default for the ledger): failed statements, or jobs run more than once. The storm stops
    at the first sign (a failed statement costs its racer a TTL, and racers queue behind a
    broken pooled session for up to PgBouncer's query wait: waiting for the end took minutes)."""
    runs = tmp_path / "runs"
    runs.touch()
    errors = Path(f"{runs}.errors")

    def broken() -> bool:
        twice = any(n > 1 for n in Counter(runs.read_text().split()).values())
        return twice or (errors.exists() and "prepared" in errors.read_text().split())

    _storm(bouncer, database, runs, prepare=True, jobs=6, until=broken)
    failed = "prepared" in (errors.read_text().split() if errors.exists() else [])
    ran = Counter(runs.read_text().split())
    twice = {k: n for k, n in ran.items() if n > 1}
    assert failed or twice, "prepared statements through the pooler went unnoticed"


def test_the_backend_sees_a_pooler_and_a_direct_connection(bouncer: PgBouncer) -> None:
    via = psycopg.connect(bouncer.url.replace("+psycopg", ""), autocommit=True)
    direct = psycopg.connect(PostgresDatabase.default_admin_url.replace("+psycopg", ""),
                             autocommit=True)  # fmt: skip
    try:
        assert postgres.behind_pooler(via) is True
        assert postgres.behind_pooler(direct) is False
    finally:
        via.close()
        direct.close()


def test_start_refuses_a_pooler_refusing_the_startup_options_with_the_fix() -> None:
    from devstack.local_pgbouncer import unavailable

    if unavailable() is not None:
        pytest.skip(unavailable())
    with PgBouncer(ignore_startup_parameters=()) as strict:
        backend = postgres.PostgresBackend.from_url(strict.url)
        try:
            findings = _startup_findings(backend, strict.url)
        finally:
            backend.close()
    assert [f.refuse for f in findings] == [True]
    assert "ignore_startup_parameters = options" in findings[0].problem


def test_start_accepts_a_transaction_pooler(bouncer: PgBouncer) -> None:
    backend = postgres.PostgresBackend.from_url(bouncer.url)
    try:
        assert _startup_findings(backend, bouncer.url) == []
        assert backend.pooled is True
    finally:
        backend.close()


def test_the_wait_behind_a_pooler_sees_a_release(bouncer: PgBouncer) -> None:
    with PostgresDatabase() as db:
        waiter = postgres.PostgresBackend.from_url(bouncer.url_for(db.name), prefix="w")
        holder = postgres.PostgresBackend.from_url(db.url, prefix="w")
        try:
            lease = holder.try_acquire("k", 30.0)
            assert lease is not None and isinstance(waiter.attempt("k", 5.0), Busy)
            assert waiter.pooled is True
            assert lease.release()
            started = time.monotonic()
            waiter.wait_for_release("k", 3.0)
            assert time.monotonic() - started < 1.0, "the polled wait missed the release"
            wait_for(lambda: waiter.try_acquire("k", 5.0), 10.0)
        finally:
            waiter.close()
            holder.close()


def test_the_ledger_engine_prepares_nothing_through_pgbouncer(database: PostgresDatabase) -> None:
    """Two workers' ledger engines (JOBFENCE_DATABASE_URL) share the pooler's one server
    session: psycopg's default would prepare `_pg3_0` there for each of them."""
    from devstack.local_pgbouncer import unavailable

    if unavailable() is not None:
        pytest.skip(unavailable())
    with PgBouncer(pool_size=1) as single:
        url = single.url_for(database.name)
        engines = [make_engine(url), make_engine(url)]
        holder = postgres.PostgresBackend.from_url(database.url, prefix="ledger")
        try:
            for i in range(6):  # psycopg prepares at the 6th run of a statement
                for n, engine in enumerate(engines):
                    key = f"ledger:{n}:{i}"
                    lease = holder.try_acquire(key, 30.0)
                    assert lease is not None
                    with SqlEffects(engine).transaction(
                        JobContext(key=key, fingerprint="fp", lease=lease)
                    ) as tx:
                        tx.conn.execute(ledger.insert().values(job_key=key))
                    lease.release()
        finally:
            holder.close()
            for engine in engines:
                engine.dispose()
    assert len(_ledger(database)) == 12
