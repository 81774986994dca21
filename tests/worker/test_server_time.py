"""`locks list/inspect/orphans` age heartbeats on the lock server's clock, on every backend."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from jobfence.locks import MemoryBackend, open_backend
from jobfence.locks.backends.mysql import MySQLBackend
from jobfence.locks.backends.postgres import PostgresBackend
from jobfence.worker.admin import server_time

#: A clock no host shows: 2001-09-09 01:46:40 UTC.
FAKE_NOW = 1_000_000_000.0


def test_a_backend_without_a_server_clock_answers_with_the_local_one() -> None:
    before = time.time()
    now = server_time(MemoryBackend())
    assert before <= now <= time.time()


def test_postgres_time_is_the_servers_clock_timestamp(pg_url: str) -> None:
    # A session whose clock_timestamp() is shadowed by a fixed one: the answer must be it,
    # which the local clock (the old fallback) never is.
    admin = sa.create_engine(pg_url, poolclass=sa.NullPool)
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql("CREATE SCHEMA IF NOT EXISTS fakeclock")
            conn.exec_driver_sql(
                "CREATE OR REPLACE FUNCTION fakeclock.clock_timestamp() RETURNS timestamptz "
                f"LANGUAGE sql AS $$ SELECT to_timestamp({FAKE_NOW}) $$"
            )
    finally:
        admin.dispose()
    backend = open_backend(pg_url)
    assert isinstance(backend, PostgresBackend)
    try:
        real = server_time(backend)
        assert abs(real - time.time()) < 60.0  # the real server clock, on this host
        with backend._conn("test", None) as conn:  # the pool's one idle connection
            conn.execute("SET search_path = fakeclock, pg_catalog, public")
        sent = backend.statements
        assert server_time(backend) == pytest.approx(FAKE_NOW, abs=1e-3)
        assert backend.statements == sent + 1
    finally:
        backend.close()


def test_mysql_time_is_the_servers_now(mariadb_url: str) -> None:
    backend = open_backend(mariadb_url)
    assert isinstance(backend, MySQLBackend)
    try:
        real = server_time(backend)
        assert abs(real - time.time()) < 60.0
        conn = backend._pool.get()  # the pool's one idle connection: its session clock moves
        with conn.cursor() as cur:
            cur.execute("SET timestamp = %s", (FAKE_NOW,))
        backend._pool.put(conn)
        assert server_time(backend) == pytest.approx(FAKE_NOW, abs=1e-3)
    finally:
        backend.close()
