"""`jobfence migrate`: jobfence's tables on demand, idempotent; `--sql` prints DDL that works."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from jobfence.config.settings import ENV_PREFIX
from jobfence.locks import SYSTEM_CLOCK, Lease, MemoryBackend, open_backend
from jobfence.tasks import JobContext, SqlEffects, make_engine
from jobfence.tasks.effects import TABLES
from jobfence.worker.cli import main
from tests.servers import (
    MARIADB_ADMIN_URL,
    POSTGRES_ADMIN_URL,
    MariaDBDatabase,
    PostgresDatabase,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMES = sorted(t.name for t in TABLES)
URL_VARIABLE = f"{ENV_PREFIX}DATABASE_URL"
LOCK_VARIABLE = f"{ENV_PREFIX}LOCK_URL"
#: The lock backends' objects, by the scratch database's kind.
LOCK_OBJECTS = {
    "postgresql": ["jobfence_locks", "jobfence_lock_fence_seq"],
    "mariadb": [f"jobfence_lock_{n}" for n in ("leases", "records", "fence", "marks", "rates")],
}


@pytest.fixture(autouse=True)
def _no_lock_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock URL from the caller's environment would add its tables to every run."""
    monkeypatch.delenv(LOCK_VARIABLE, raising=False)


@pytest.fixture(params=["postgresql", "mariadb"])
def fresh_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A new scratch database (its name in ``request.param``), dropped afterwards."""
    kind, admin = {
        "postgresql": (PostgresDatabase, POSTGRES_ADMIN_URL),
        "mariadb": (MariaDBDatabase, MARIADB_ADMIN_URL),
    }[request.param]
    if (reason := kind.reachable(admin)) is not None:
        pytest.skip(reason)
    with kind() as db:
        yield db.url


def tables_in(url: str) -> list[str]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        return sorted(set(sa.inspect(engine).get_table_names()) & set(NAMES))
    finally:
        engine.dispose()


def test_migrate_creates_the_tables_then_finds_them(
    fresh_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["migrate", "--database", fresh_url]) == 0
    first = capsys.readouterr().out
    assert all(f"{name}: created" in first for name in NAMES), first
    assert tables_in(fresh_url) == NAMES

    assert main(["migrate", "--database", fresh_url]) == 0
    second = capsys.readouterr().out
    assert all(f"{name}: already there" in second for name in NAMES), second


def test_migrate_reads_the_database_url_from_the_environment(
    fresh_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(URL_VARIABLE, fresh_url)
    assert main(["migrate"]) == 0
    assert tables_in(fresh_url) == NAMES


def test_the_printed_ddl_makes_tables_jobfence_works_with(fresh_url: str) -> None:
    # As a DBA would: print the DDL, run it as-is, then let a worker use the tables.
    done = subprocess.run(
        [sys.executable, "-m", "jobfence", "migrate", "--sql", "--database", fresh_url],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if k not in (URL_VARIABLE, LOCK_VARIABLE)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    statements = [s.strip() for s in done.stdout.split(";") if s.strip()]
    indexes = sum(len(t.indexes) for t in TABLES)  # the outbox's index of unsent rows
    assert len(statements) == len(NAMES) + indexes
    assert all(s.startswith(("CREATE TABLE IF NOT EXISTS", "CREATE INDEX IF NOT EXISTS"))
               for s in statements)  # fmt: skip
    assert tables_in(fresh_url) == []  # printing ran nothing
    admin = sa.create_engine(fresh_url, poolclass=sa.NullPool)
    try:
        for _ in range(2):  # and running it twice is harmless
            with admin.begin() as conn:
                for statement in statements:
                    conn.exec_driver_sql(statement)
    finally:
        admin.dispose()
    assert tables_in(fresh_url) == NAMES

    engine = make_engine(fresh_url)
    try:
        lease = Lease(
            key="k", owner="o", fence=3, ttl=30.0, deadline=SYSTEM_CLOCK.monotonic() + 30.0,
            backend=MemoryBackend(), clock=SYSTEM_CLOCK,
        )  # fmt: skip
        effects = SqlEffects(engine)
        with effects.transaction(JobContext(key="k", fingerprint="fp", lease=lease), "r") as tx:
            tx.result = {"ok": 1}
        assert effects.record("k") is not None
    finally:
        engine.dispose()


def test_migrate_sql_connects_to_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    unreachable = "postgresql+psycopg://nobody@127.0.0.1:9/none"
    assert main(["migrate", "--sql", "--database", unreachable]) == 0
    out = capsys.readouterr().out
    assert out.count("CREATE TABLE IF NOT EXISTS") == len(NAMES)
    assert "BIGINT" in out


def test_migrate_without_a_database_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(URL_VARIABLE, raising=False)
    assert main(["migrate"]) == 2
    err = capsys.readouterr().err
    assert URL_VARIABLE in err and "--database" in err


def test_migrate_errors_never_show_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql+psycopg://jobfence:hunter2-secret@127.0.0.1:9/app"
    assert main(["migrate", "--database", url]) == 1
    err = capsys.readouterr().err
    assert "hunter2-secret" not in err
    assert "127.0.0.1" in err


def test_migrate_refuses_a_url_it_cannot_parse(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "--database", "not a url"]) == 2
    assert "bad database URL" in capsys.readouterr().err


def lock_objects_in(url: str) -> list[str]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        inspector = sa.inspect(engine)
        names = set(inspector.get_table_names())
        if engine.dialect.name == "postgresql":
            names |= set(inspector.get_sequence_names())
        return sorted(n for n in names if n.startswith("jobfence_lock"))
    finally:
        engine.dispose()


def test_migrate_creates_the_lock_tables_and_a_lease_can_be_taken(
    fresh_url: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    kind = request.node.callspec.params["fresh_url"]
    expected = sorted(LOCK_OBJECTS[kind])
    monkeypatch.delenv(URL_VARIABLE, raising=False)
    monkeypatch.setenv(LOCK_VARIABLE, fresh_url)  # the lock URL alone: no effects database
    assert lock_objects_in(fresh_url) == []
    assert main(["migrate"]) == 0
    first = capsys.readouterr().out
    assert all(f"{name}: created" in first for name in expected), first
    assert lock_objects_in(fresh_url) == expected
    assert tables_in(fresh_url) == []  # no database URL: the effects' tables were not asked for

    backend = open_backend(fresh_url)
    try:
        lease = backend.try_acquire("migrated", 5.0)
        assert lease is not None and lease.fence > 0
        assert backend.try_acquire("migrated", 5.0) is None
        lease.release()
    finally:
        backend.close()

    monkeypatch.delenv(LOCK_VARIABLE)
    assert main(["migrate", "--lock-url", fresh_url, "--database", fresh_url]) == 0
    second = capsys.readouterr().out
    assert all(f"{name}: already there" in second for name in expected), second
    assert all(f"{name}: created" in second for name in NAMES), second


@pytest.mark.parametrize(
    ("lock_url", "table"),
    [
        ("postgresql+psycopg://nobody@127.0.0.1:9/none", "IF NOT EXISTS jobfence_locks ("),
        ("mariadb://nobody@127.0.0.1:9/none", "IF NOT EXISTS `jobfence_lock_leases` ("),
    ],
)
def test_migrate_sql_prints_the_lock_tables_too(
    lock_url: str, table: str, capsys: pytest.CaptureFixture[str]
) -> None:
    unreachable = "postgresql+psycopg://nobody@127.0.0.1:9/none"
    assert main(["migrate", "--sql", "--database", unreachable, "--lock-url", lock_url]) == 0
    out = capsys.readouterr().out
    assert table in out, out
    assert out.count("CREATE TABLE IF NOT EXISTS") > len(NAMES)


def test_migrate_makes_no_tables_for_redis_locks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(URL_VARIABLE, raising=False)
    assert main(["migrate", "--lock-url", "redis://127.0.0.1:6379/0"]) == 2
    err = capsys.readouterr().err
    assert URL_VARIABLE in err and "--lock-url" in err


def test_migrate_lock_errors_never_show_the_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(URL_VARIABLE, raising=False)
    for url in (
        "postgresql://jobfence:hunter2-secret@127.0.0.1:9/app",
        "mysql://jobfence:hunter2-secret@127.0.0.1:9/app",
    ):
        assert main(["migrate", "--lock-url", url]) == 1
        err = capsys.readouterr().err
        assert "hunter2-secret" not in err and "127.0.0.1" in err, err
