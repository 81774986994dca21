"""Prefork children never use a connection their parent opened: jobfence's engines are disposed
after fork, so an app that touches PostgreSQL at import still runs every task cleanly."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from tests.integration.apps.common import app_env, make_app
from tests.integration.celery_fleet import FleetFactory
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase, RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.fork_app"  # not imported here: it touches the database at import
# The app's records in Redis (see its docstring).
FAILURES, INVALIDATED = "fork:failures", "fork:invalidated"
CHILDREN, PARENT_SESSIONS = "fork:children", "fork:parent-sessions"
TASKS = 400
CONCURRENCY = 4
BROKER_DB, LEDGER_DB, LOCK_DB = 0, 1, 2


@pytest.fixture(scope="module")
def database() -> Iterator[PostgresDatabase]:
    if (reason := PostgresDatabase.reachable(POSTGRES_ADMIN_URL)) is not None:
        pytest.skip(reason)
    with PostgresDatabase() as db:
        yield db


def rows_by_task(url: str) -> dict[str, list[dict[str, Any]]]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT task, n, pid, backend_pid FROM fork_writes")
            ).mappings().all()
    finally:
        engine.dispose()
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        out[row["task"]].append(dict(row))
    return out


def shared_sessions(rows: list[dict[str, Any]]) -> dict[int, set[int]]:
    """Backend sessions written through by more than one worker process."""
    pids: dict[int, set[int]] = defaultdict(set)
    for row in rows:
        pids[row["backend_pid"]].add(row["pid"])
    return {backend: p for backend, p in pids.items() if len(p) > 1}


def test_prefork_children_never_use_the_parents_database_connections(
    module_redis: RedisServer, fleet_factory: FleetFactory, database: PostgresDatabase
) -> None:
    server = f"redis://{module_redis.host}:{module_redis.port}"
    env = app_env(
        f"{server}/{BROKER_DB}",
        ledger_url=f"{server}/{LEDGER_DB}",
        visibility_timeout=600.0,  # no redelivery: every execution is one we sent
        LOCK_URL=f"{server}/{LOCK_DB}",
        DATABASE_URL=database.url,
        LEASE_TTL="10",
    )
    fleet = fleet_factory(APP, env=env, workers=1, concurrency=CONCURRENCY, ready_timeout=60.0)
    client = make_app("fork-client", env)
    broker = redis.Redis.from_url(env["BROKER_URL"])
    ledger = redis.Redis.from_url(env["LEDGER_URL"], decode_responses=True)
    try:
        for n in range(TASKS):  # interleaved: each child meets both engines at once
            client.send_task("fork.naive", args=[n])
            client.send_task("fork.fenced", args=[n])
        fleet.wait_idle(broker, timeout=300.0)
        failures = ledger.lrange(FAILURES, 0, -1)
        invalidated = ledger.lrange(INVALIDATED, 0, -1)
        children = [json.loads(c) for c in ledger.lrange(CHILDREN, 0, -1)]
        parent = {k: int(v) for k, v in ledger.hgetall(PARENT_SESSIONS).items()}
    finally:
        broker.close()
        ledger.close()
        client.close()
    rows = rows_by_task(database.url)
    assert len(children) == CONCURRENCY, children
    report = {
        name: {
            "failed": sum(f.startswith(f"fork.{name}") for f in failures),
            "wrote": len(rows[name]),
            "connections thrown away": sum(i.startswith(name) for i in invalidated),
            "children starting with the parent's connection": sum(c[name] for c in children),
            "rows on the parent's session": sum(
                r["backend_pid"] == parent[name] for r in rows[name]
            ),
        }
        for name in ("naive", "fenced")
    }
    print(f"\n{TASKS} tasks each, {CONCURRENCY} prefork children: {report}")
    print("\n".join(failures[:4]))

    # Control: the app's own engine, touched in the parent and not disposed, hands the
    # parent's connection to every child (deterministic), and the children sharing its
    # socket fail or throw connections away.
    naive = report["naive"]
    assert all(c["naive"] == 1 for c in children), children
    shown = ("failed", "connections thrown away", "rows on the parent's session")
    assert sum(naive[k] for k in shown) > 0, naive

    # jobfence's engine was touched in the parent just the same, and no child ever used it.
    assert all(c["fenced"] == 0 for c in children), children
    assert [f for f in failures if f.startswith("fork.fenced")] == []
    assert [i for i in invalidated if i.startswith("fenced")] == []
    assert sorted(r["n"] for r in rows["fenced"]) == list(range(TASKS))
    assert report["fenced"]["rows on the parent's session"] == 0
    assert shared_sessions(rows["fenced"]) == {}
