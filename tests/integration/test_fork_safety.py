"""Prefork children never use a connection their parent opened: jobfence's engines are disposed
after fork, so an app that touches PostgreSQL at import still runs every task cleanly; and a
child forked while a thread of its parent is inside jobfence (the decision log's writer on a
stalled lock server) does not inherit that thread's locks."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from jobfence.locks import RedisBackend
from jobfence.locks.decisions import Decision, DecisionBounds, DecisionLog
from jobfence.tasks.decisions import DecisionRecorder
from tests.forked import CHILD_DEADLINE, start_child, wait_child
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


class InFlight(DecisionLog):
    """A real decision log that tells when a batch is on its way to the server and back."""

    where = "Redis streams"

    def __init__(self, log: DecisionLog) -> None:
        super().__init__(log.bounds)
        self.log = log
        self.sent, self.back = threading.Event(), threading.Event()

    def append_many(self, entries: Sequence[Decision]) -> None:
        self.sent.set()
        try:
            self.log.append_many(entries)
        finally:
            self.back.set()

    def for_key(self, key: str, n: int = 50) -> list[Decision]:
        return self.log.for_key(key, n)

    def for_task(self, task_id: str, n: int = 50) -> list[Decision]:
        return self.log.for_task(task_id, n)


def skipped(key: str, task_id: str) -> Decision:
    return Decision(time.time(), "conflict", key, "tests.fork", task_id, holder="h", reason="skip")


def test_a_child_forked_while_the_decision_writer_waits_on_a_stalled_server_stores_its_own(
    fresh_redis: RedisServer,
) -> None:
    """The parent's writer holds its batch lock for up to socket_timeout while the server is
    stopped; the child forked then stores its own decisions once the server is back, and its
    close() returns. Control (today's main, before the at-fork reset): the child's writer and
    its close() wait for the parent's lock for ever, and the child is killed at its deadline."""
    # A long socket timeout: the parent's batch stays in flight across the fork.
    backend = RedisBackend.from_url(fresh_redis.url, prefix="forkdl", socket_timeout=20.0)
    store = backend.decision_log(DecisionBounds())
    assert store is not None
    log = InFlight(store)
    recorder = DecisionRecorder(log)
    recorder.record([skipped("tests.fork:parent", "p0")])
    recorder.flush()  # connected: the batch below is on the wire, waiting for its reply
    log.sent.clear()
    log.back.clear()
    fresh_redis.pause()  # SIGSTOP: the writer's round trip hangs
    try:
        recorder.record([skipped("tests.fork:parent", "p1")])
        assert log.sent.wait(CHILD_DEADLINE), "the writer never sent its batch"

        def child() -> None:
            recorder.record([skipped("tests.fork:child", "c1")])
            recorder.close()  # stores what was handed over (or warns): never waits for ever

        assert not log.back.is_set(), "the parent's batch must be in flight at the fork"
        pid = start_child(child)
    finally:
        fresh_redis.resume()
    try:
        code = wait_child(pid)
        assert code is not None, f"the child hung: killed after {CHILD_DEADLINE:g}s"
        assert code == 0, code
        assert [d.task_id for d in store.for_key("tests.fork:child")] == ["c1"]
        recorder.close()
        assert [d.task_id for d in store.for_key("tests.fork:parent")] == ["p0", "p1"]
    finally:
        backend.close()
