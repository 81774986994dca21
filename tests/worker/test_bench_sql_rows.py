"""The lock benchmark's SQL rows run on the local servers, skip with a reason, leave no database."""

from __future__ import annotations

import os

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from devstack.bench import locks_bench, sql_rows
from tests.servers import MARIADB_ADMIN_URL, POSTGRES_ADMIN_URL, MariaDBDatabase, PostgresDatabase


def _ours(url: str) -> set[str]:
    """Scratch databases of this process's benchmarks (other helpers make their own)."""
    eng = sa.create_engine(url, poolclass=NullPool)
    query = "SELECT datname FROM pg_database" if url.startswith("postgresql") else "SHOW DATABASES"
    try:
        with eng.connect() as conn:
            names = {str(n) for n in conn.execute(sa.text(query)).scalars()}
    finally:
        eng.dispose()
    return {n for n in names if n.startswith(f"jobfence_bench_{os.getpid()}_")}


def test_sql_rows_run_and_leave_no_scratch_database() -> None:
    servers = {"PostgreSQL": POSTGRES_ADMIN_URL, "MariaDB": MARIADB_ADMIN_URL}
    for label, url in servers.items():
        cls = PostgresDatabase if label == "PostgreSQL" else MariaDBDatabase
        if cls.reachable(url) is not None:
            servers[label] = ""  # skipped, with a reason, like a missing server in the bench
    args = locks_bench.parse_args(
        ["--rounds", "1", "--warmup", "0", "--waiters", "1", "--sql-pairs", "3",
         "--postgres", servers["PostgreSQL"], "--mariadb", servers["MariaDB"]]
    )  # fmt: skip
    sql = locks_bench.run_sql(args)
    rows = {r["name"]: r for r in sql["rows"]}
    for label, url in servers.items():
        if not url:
            assert "not asked for" in sql["skipped"][label]
            continue
        advisory_row = rows[f"{label} advisory xact lock"]
        assert advisory_row["us_per_pair"] > 0 and advisory_row["wake_n"] == 1
        lease = f"{label} lease"
        assert lease in rows or "no lease backend" in sql["skipped"][lease]
        assert not _ours(url)  # the scratch database is gone
    assert sql["anchor"] == sql_rows.ANCHOR and "~2 ms" in sql["anchor"]
