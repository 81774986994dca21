"""Every Celery delivery path with real workers: a @singleton_task's body takes effect once.

Each test mirrors a control in ``test_controls.py``, where the same path makes a plain task
run twice (or more); here the same path, on the same broker settings, runs the body once,
or, where a dead or frozen holder forces a second run, the fence and the SQL DONE row keep
the effect single.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from devstack.redis_masters import RedisMasters
from jobfence.locks.backend import JobRecord
from jobfence.tasks import ArgumentsNotSerializable, DuplicateSkipped, Runtime, runtime_for
from tests.integration.apps import singleton_app
from tests.integration.apps.common import app_env
from tests.integration.celery_fleet import Fleet, FleetFactory, broker_backlog
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.singleton_app"
VISIBILITY_TIMEOUT = 2.0
RESTORE_INTERVAL = 0.5
LEASE_TTL = 2.0
#: Longest a message can stay invisible after its consumer stopped acking (as in the controls).
REDELIVERY_DEADLINE = VISIBILITY_TIMEOUT + RESTORE_INTERVAL + 8.0
#: A lost holder's lease runs out within one TTL; add a redelivery and a deferred copy.
TAKEOVER_DEADLINE = REDELIVERY_DEADLINE + 2 * LEASE_TTL
#: Redis databases of the module's server: broker 0, ledger 1, locks 2, results 3.
LOCK_DB = 2
#: A queue no worker consumes, to see whether a publish reached the broker.
PARKED_QUEUE = "it-parked"


@dataclass
class Singletons:
    """What a delivery-path test needs: fleet, publishing client, runtime, ledgers, broker."""

    fleet: Fleet
    app: Celery
    runtime: Runtime
    ledger: Ledger
    broker: redis.Redis
    sql: sa.Engine
    jobs: list[str] = field(default_factory=list)

    def job(self) -> str:
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        self.jobs.append(job_id)
        return job_id

    def task(self, name: str) -> Any:
        return self.app.tasks[name]

    def send(self, name: str, *args: Any, **options: Any) -> AsyncResult:
        return self.task(name).apply_async(args=list(args), **options)

    def key(self, name: str, *args: Any, explicit: str | None = None) -> str:
        key: str = self.task(name).identity(list(args), {}, explicit)[0]
        return key

    def record(self, key: str) -> JobRecord | None:
        return self.runtime.backend.job_record(key)

    def stored_result(self, key: str) -> Any:
        """The result in the job's DONE record (what duplicates are answered with)."""
        record = self.record(key)
        assert record is not None and record.state == "DONE", record
        return json.loads(record.result)

    def waiting_for_release(self, task_id: str) -> bool:
        """True while some client of the lock database blocks on a release signal (BLPOP);
        on a SQL backend (MariaDB polls, PostgreSQL LISTENs), once the waiting delivery has
        started."""
        if self.runtime.backend.name != "redis":
            return bool(self.preruns(task_id))
        lock = redis.Redis.from_url(self.runtime.settings.lock_url)  # Valkey's: its own
        try:
            db = str(lock.connection_pool.connection_kwargs.get("db", 0))
            return any(c.get("cmd") == "blpop" and c.get("db") == db for c in lock.client_list())
        finally:
            lock.close()

    def preruns(self, task_id: str) -> list[Any]:
        return [e for e in self.fleet.events(task_id) if e.kind == "prerun"]

    def outcome(
        self, job_id: str, task_id: str, state: str, timeout: float, *, after: float = 0.0
    ) -> dict[str, Any]:
        """Wait for a delivery of ``task_id`` to end in ``state`` (at a time past ``after``);
        returns its outcome."""
        found: dict[str, Any] = wait_for(
            lambda: next(
                (
                    o
                    for o in self.ledger.outcomes(job_id, task_id)
                    if o["state"] == state and o["t"] > after
                ),
                None,
            ),
            timeout,
            interval=0.02,
            message=lambda: f"no {state} outcome for {task_id}\n{self.explain(job_id)}",
        )
        return found

    def explain(self, job_id: str) -> str:
        starts = "\n".join(str(s) for s in self.ledger.starts(job_id))
        outcomes = "\n".join(str(o) for o in self.ledger.outcomes(job_id)[-20:])
        return (
            f"{self.ledger.summary(job_id)}\nstarts:\n{starts}\noutcomes (last 20):\n{outcomes}\n"
            f"sql effects: {singleton_app.effect_rows(self.sql, job_id)}\n"
            f"{self.fleet.logs(lines=15)}"
        )


@pytest.fixture(scope="module")
def redlock_urls() -> Iterator[str]:
    """A redlock:// URL over three private masters, for the module."""
    with RedisMasters(3) as masters:
        yield masters.url


@dataclass
class _Module:
    fleet: Fleet
    app: Celery
    ledger: Ledger
    broker: redis.Redis


@pytest.fixture(
    scope="module",
    params=["redis", "mariadb", "postgres", "etcd", "redlock", "zookeeper", "valkey"],
)
def singleton_module(
    request: pytest.FixtureRequest,
    module_redis: RedisServer,
    fleet_factory: FleetFactory,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[_Module]:
    """The fleet, with its locks on Redis, MariaDB, PostgreSQL, etcd, Redlock over three
    masters, ZooKeeper or Valkey (JOBFENCE_LOCK_URL alone differs)."""
    server = f"redis://{module_redis.host}:{module_redis.port}"
    lock_url = f"{server}/{LOCK_DB}"
    if request.param == "mariadb":
        lock_url = request.getfixturevalue("mariadb_url")
    elif request.param == "postgres":
        lock_url = request.getfixturevalue("pg_url")
    elif request.param == "etcd":
        lock_url = request.getfixturevalue("etcd_server").url
    elif request.param == "redlock":  # three private masters of its own
        lock_url = request.getfixturevalue("redlock_urls")
    elif request.param == "zookeeper":
        lock_url = f"{request.getfixturevalue('zookeeper_server').url}/delivery-paths"
    elif request.param == "valkey":
        lock_url = request.getfixturevalue("module_valkey").url
    database_url = f"sqlite:///{tmp_path_factory.mktemp('sql-ledger') / 'ledger.sqlite'}"
    env = app_env(
        module_redis.url,  # broker: db 0
        ledger_url=f"{server}/1",
        visibility_timeout=VISIBILITY_TIMEOUT,
        restore_interval=RESTORE_INTERVAL,
        LOCK_URL=lock_url,
        RESULT_BACKEND=f"{server}/3",
        DATABASE_URL=database_url,
        LEASE_TTL=repr(LEASE_TTL),
        LOCK_SOCKET_TIMEOUT="0.5",
    )
    singleton_app.create_schema(database_url)
    fleet = fleet_factory(APP, env=env, workers=2, concurrency=2)
    app = singleton_app.create_app(env, name="singleton-client")
    ledger = Ledger.from_url(f"{server}/1")
    try:
        yield _Module(fleet, app, ledger, module_redis.client())
    finally:
        ledger.close()
        runtime_for(app).close()
        app.close()
        # The next parameter's fleet shares the module's broker: nothing of this one may
        # take its messages (the private server only).
        fleet.stop()
        module_redis.client().flushall()


@pytest.fixture
def sng(singleton_module: _Module) -> Iterator[Singletons]:
    """A healthy, idle fleet and an empty ledger; afterwards, gates opened and the fleet idle."""
    m = singleton_module
    m.fleet.ensure_running()
    m.ledger.reset()
    runtime = runtime_for(m.app)
    s = Singletons(m.fleet, m.app, runtime, m.ledger, m.broker, runtime.effects.engine)
    yield s
    for job_id in s.jobs:
        m.ledger.release(job_id)
    try:
        m.fleet.wait_idle(m.broker, timeout=20.0)
    except AssertionError:
        # Left-overs would leak into the next test: start over from an empty broker.
        m.fleet.stop(timeout=2.0)
        m.broker.flushall()
        m.fleet.start()


@pytest.mark.parametrize("singleton_module", ["redis", "mariadb", "postgres"], indirect=True)
def test_same_job_published_1000_times_runs_once(sng: Singletons) -> None:
    """On the three lock implementations a storm meets most (Lua, SQL with LISTEN, SQL
    polling); etcd, Redlock and ZooKeeper answer duplicates through the same Busy and DONE
    paths, which their contract and delivery tests below cover."""
    job = sng.job()
    task = sng.task("singleton.record")
    with sng.app.producer_or_acquire() as producer:
        ids = [task.apply_async(args=[job], producer=producer).id for _ in range(1000)]
    metas = dict(sng.app.backend.get_many(ids, timeout=90.0, interval=0.2))
    sng.fleet.wait_idle(sng.broker)
    stored = sng.stored_result(sng.key("singleton.record", job))
    assert stored == 1  # the body's return value: the first and only effect
    assert len(metas) == 1000
    # Each answered with the result, or stopped as a duplicate of the running copy.
    ends = {(m["status"], repr(m["result"]) if m["status"] == "SUCCESS" else type(m["result"]))
            for m in metas.values()}  # fmt: skip
    assert ends <= {("SUCCESS", repr(stored)), ("FAILURE", DuplicateSkipped)}, ends
    assert sng.ledger.start_count(job) == 1, sng.explain(job)
    assert sng.ledger.effect_count(job) == 1, sng.explain(job)
    # 1,000 deliveries really reached the gate, on both workers.
    published = set(ids)
    preruns = [e for e in sng.fleet.events() if e.kind == "prerun" and e.task_id in published]
    assert len(preruns) >= 1000
    assert {e.worker for e in preruns} == {0, 1}


#: Paths decided by the broker and the publishing side alone (the gate sees an ordinary
#: duplicate, as in the 1000-publish test): run once, on Redis, not on every lock backend.
BROKER_SIDE_ONLY = pytest.mark.parametrize("singleton_module", ["redis"], indirect=True)


@BROKER_SIDE_ONLY
def test_countdown_longer_than_visibility_timeout_runs_once(sng: Singletons) -> None:
    job = sng.job()
    countdown = 2.5 * VISIBILITY_TIMEOUT
    sent = time.time()
    result = sng.send("singleton.record", job, countdown=countdown)
    # The broker hands the waiting message out again every visibility timeout (the control
    # runs it 2-3 times): wait until a second copy has reached the gate.
    wait_for(
        lambda: len(sng.preruns(result.id)) >= 2,
        countdown + REDELIVERY_DEADLINE,
        interval=0.05,
        message=lambda: sng.explain(job),
    )
    sng.fleet.wait_idle(sng.broker, timeout=30.0)
    starts = sng.ledger.starts(job)
    assert len(starts) == 1 and sng.ledger.effect_count(job) == 1, sng.explain(job)
    assert starts[0]["t"] >= sent + countdown - 0.5, "ran before its ETA"
    outcomes = sng.ledger.outcomes(job, result.id)
    assert len(outcomes) >= 2, sng.explain(job)
    # Every other copy got the stored result, or was deferred while the body ran.
    assert all(
        (o["state"] == "SUCCESS" and o["value"] == 1) or o["state"] == "IGNORED" for o in outcomes
    ), outcomes
    assert result.get(timeout=10.0) == 1


def test_task_longer_than_visibility_timeout_never_runs_beside_its_redelivered_copy(
    sng: Singletons,
) -> None:
    job = sng.job()
    result = sng.send("singleton.gated", job, 30.0)
    sng.fleet.wait_executing(result.id, count=1)
    # The body under way (a first delivery that met a slow lock server was delivered again
    # before it ran: that copy's IGNORED is not the one this test is about).
    wait_for(lambda: sng.ledger.start_count(job) == 1, REDELIVERY_DEADLINE,
             message=lambda: sng.explain(job))  # fmt: skip
    began = sng.ledger.starts(job)[0]["t"]
    # Still at the gate past the visibility timeout: a redelivered copy arrives and is
    # deferred (re-published for after the lease) instead of running beside the body.
    deferred = sng.outcome(job, result.id, "IGNORED", REDELIVERY_DEADLINE, after=began)
    assert sng.ledger.end_count(job) == 0, "the first body should still be at the gate"
    assert sng.ledger.start_count(job) == 1, sng.explain(job)
    sng.ledger.release(job)
    assert result.get(timeout=15.0) == 1
    sng.fleet.wait_idle(sng.broker, timeout=30.0)
    first = sng.ledger.starts(job)[0]
    assert deferred["t"] > first["t"]
    assert sng.ledger.start_count(job) == 1, sng.explain(job)  # nor again after it
    assert sng.ledger.max_concurrent(job) == 1, sng.explain(job)
    assert sng.ledger.effect_count(job) == 1, sng.explain(job)
    assert len(sng.preruns(result.id)) >= 2


def test_killed_child_job_completes_elsewhere_after_its_lease_with_one_sql_effect(
    sng: Singletons,
) -> None:
    job = sng.job()
    name = "singleton.sql_gated"
    key = sng.key(name, job, 30.0, True)
    result = sng.send(name, job, 30.0, True)  # effect (and SQL DONE row) first, then block
    (victim,) = sng.fleet.wait_executing(result.id, count=1)
    wait_for(
        lambda: singleton_app.effect_rows(sng.sql, job),
        10.0,
        message=lambda: sng.explain(job),
    )
    first = sng.ledger.starts(job)[0]
    asked = time.time()
    held = sng.runtime.backend.inspect(key)
    assert held is not None and held.fence == first["fence"], held
    # Extensions only push it later. etcd reports whole seconds, rounded up to "at the
    # latest" (locks/backends/etcd/inspection.py `_ttl_left`): its lease may end up to 1 s sooner.
    granularity = 1.0 if sng.runtime.backend.name == "etcd" else 0.0
    expires_no_earlier = asked + held.ttl_left - granularity - 0.01
    sng.fleet.kill_child(victim)
    sng.ledger.release(job)
    sng.outcome(job, result.id, "SUCCESS", TAKEOVER_DEADLINE + 5.0)  # reject may take 5 s
    sng.fleet.wait_idle(sng.broker, timeout=30.0)

    starts = sng.ledger.starts(job)
    assert len(starts) == 2, sng.explain(job)
    second = starts[1]
    assert second["pid"] != victim and second["fence"] > first["fence"]
    assert second["t"] >= expires_no_earlier, (second["t"], expires_no_earlier)
    rows = singleton_app.effect_rows(sng.sql, job)
    assert len(rows) == 1, sng.explain(job)
    assert (rows[0]["pid"], rows[0]["fence"]) == (victim, first["fence"])
    # The second holder found the SQL DONE row and returned its result: no second effect.
    stored = {"job": job, "fence": first["fence"], "pid": victim}
    assert result.get(timeout=10.0) == stored
    sql_done = sng.runtime.effects.record(key)
    assert sql_done is not None and sql_done["fence"] == first["fence"]
    record = sng.record(key)
    assert record is not None and record.state == "DONE" and record.fence == second["fence"]


def test_frozen_child_resumed_after_another_finished_is_refused_by_the_fence(
    sng: Singletons,
) -> None:
    job = sng.job()
    name = "singleton.sql_gated"
    key = sng.key(name, job, 60.0, False)
    result = sng.send(name, job, 60.0, False)  # block first, then the effect
    (frozen,) = sng.fleet.wait_executing(result.id, count=1)
    wait_for(lambda: sng.ledger.start_count(job) >= 1, 10.0, message=lambda: sng.explain(job))
    first = sng.ledger.starts(job)[0]
    with sng.fleet.paused(frozen):
        # Its keeper is frozen too: the lease runs out, the redelivered copy takes over.
        wait_for(
            lambda: sng.ledger.start_count(job) >= 2,
            TAKEOVER_DEADLINE,
            interval=0.05,
            message=lambda: sng.explain(job),
        )
        second = sng.ledger.starts(job)[1]
        assert second["pid"] != frozen and second["fence"] > first["fence"]
        sng.ledger.release(job)
        wait_for(
            lambda: (r := sng.record(key)) is not None and r.state == "DONE",
            10.0,
            message=lambda: sng.explain(job),
        )
    # Thawed, the first holder leaves the gate and tries its write with the old fence.
    stale = wait_for(
        lambda: next((o for o in sng.ledger.outcomes(job) if o["pid"] == frozen), None),
        15.0,
        message=lambda: sng.explain(job),
    )
    sng.fleet.wait_idle(sng.broker, timeout=30.0)
    # Superseded by a run of the same job: it answers with that run's DONE record.
    assert stale["state"] == "SUCCESS" and stale["value"] == sng.stored_result(key), stale
    refused = [e for e in sng.ledger.ends(job) if e["pid"] == frozen]
    assert len(refused) == 1 and refused[0]["refused"] == "StaleFence", refused
    assert refused[0]["last"] == second["fence"]
    rows = singleton_app.effect_rows(sng.sql, job)
    assert len(rows) == 1, sng.explain(job)
    assert (rows[0]["pid"], rows[0]["fence"]) == (second["pid"], second["fence"])
    sql_done = sng.runtime.effects.record(key)
    assert sql_done is not None and sql_done["fence"] == second["fence"]
    record = sng.record(key)  # the stale holder stored no DONE of its own
    assert record is not None and record.state == "DONE" and record.fence == second["fence"]
    assert sng.ledger.start_count(job) == 2, sng.explain(job)
    # The task's result stays the finished job's (Celery keeps a stored SUCCESS).
    assert result.get(timeout=10.0) == {"job": job, "fence": second["fence"], "pid": second["pid"]}


@pytest.mark.parametrize("name", ["singleton.flaky", "singleton.autoretry"])
def test_retries_keep_the_key_end_failed_and_a_fresh_submission_runs(
    sng: Singletons, name: str
) -> None:
    job = sng.job()
    # autoretry also travels with an explicit idempotency key, which retries must keep.
    options = {"idempotency_key": f"order-{job}"} if name == "singleton.autoretry" else {}
    key = sng.key(name, job, explicit=options.get("idempotency_key"))
    result = sng.send(name, job, **options)
    sng.outcome(job, result.id, "FAILURE", 20.0)
    sng.fleet.wait_idle(sng.broker)
    attempts = 1 + singleton_app.MAX_RETRIES
    # (An attempt's RETRY may be recorded after the next attempt ended: order by attempt.)
    outcomes = sorted(sng.ledger.outcomes(job, result.id), key=lambda o: int(o["retries"]))
    states = [o["state"] for o in outcomes]
    assert states == ["RETRY"] * (attempts - 1) + ["FAILURE"], sng.explain(job)
    starts = sng.ledger.starts(job)
    assert [s["retries"] for s in starts] == list(range(attempts)), sng.explain(job)
    assert {s["key"] for s in starts} == {key}
    assert {s["task_id"] for s in starts} == {result.id}
    # Every retry ran its body: none was deferred behind its own lease.
    assert len(sng.preruns(result.id)) == attempts
    record = sng.record(key)
    assert record is not None and record.state == "FAILED", record
    # Not asserted: result.state. Celery stores an attempt's RETRY after publishing the
    # retry, so with a zero countdown a late RETRY can overwrite the last attempt's FAILURE.
    assert "NotReady" in record.result

    sng.ledger.release(job)  # from now on the body succeeds
    fresh = sng.send(name, job, **options)
    assert fresh.get(timeout=15.0) == 1
    starts = sng.ledger.starts(job)
    assert len(starts) == attempts + 1 and starts[-1]["task_id"] == fresh.id
    assert starts[-1]["key"] == key
    record = sng.record(key)
    assert record is not None and record.state == "DONE", record


POLICY_TASKS = {
    "skip": "singleton.gated",
    "wait": "singleton.gated_wait",
    "retry": "singleton.gated_retry",
    "raise": "singleton.gated_raise",
}


@pytest.mark.parametrize("policy", list(POLICY_TASKS))
def test_conflict_policy_with_a_real_fleet(sng: Singletons, policy: str) -> None:
    job = sng.job()
    name = POLICY_TASKS[policy]
    holder = sng.send(name, job, 30.0)
    wait_for(lambda: sng.ledger.start_count(job) == 1, 10.0, message=lambda: sng.explain(job))
    other = sng.send(name, job, 30.0)  # the same job, published again while it runs
    if policy == "skip":
        got = sng.outcome(job, other.id, "FAILURE", 10.0)
        assert got["error"] == "DuplicateSkipped"
    elif policy == "raise":
        got = sng.outcome(job, other.id, "FAILURE", 10.0)
        assert got["error"] == "DuplicateJob"
    elif policy == "retry":
        # Queued behind the live copy (published again, this delivery acked), spending no
        # Celery retry: never a RETRY state while the copy it waits for lives.
        sng.outcome(job, other.id, "IGNORED", 10.0)
    else:  # blocked in the worker on the lock's release signal
        wait_for(
            lambda: sng.waiting_for_release(other.id),
            10.0,
            interval=0.005,
            message=lambda: sng.explain(job),
        )
    assert sng.ledger.end_count(job) == 0, "the holder should still be at the gate"
    sng.ledger.release(job)
    assert holder.get(timeout=15.0) == 1
    if policy == "skip":
        with pytest.raises(DuplicateSkipped):
            other.get(timeout=10.0)
    elif policy == "raise":
        other.get(timeout=10.0, propagate=False)
        assert other.state == "FAILURE" and type(other.result).__name__ == "DuplicateJob"
    else:  # it waited (in the worker, or queued behind the copy) and got the stored result
        assert other.get(timeout=15.0) == 1
        retried = [o for o in sng.ledger.outcomes(job, other.id) if o["state"] == "RETRY"]
        assert retried == [], sng.explain(job)
        done = sng.outcome(job, other.id, "SUCCESS", 1.0)
        assert done["t"] >= sng.ledger.ends(job)[0]["t"]
    sng.fleet.wait_idle(sng.broker)
    assert sng.ledger.start_count(job) == 1, sng.explain(job)
    assert sng.ledger.effect_count(job) == 1, sng.explain(job)
    record = sng.record(sng.key(name, job, 30.0))
    assert record is not None and record.state == "DONE", record


@pytest.mark.parametrize(
    "value",
    [
        dt.datetime(2026, 1, 22, 12, 0, tzinfo=dt.UTC),
        Decimal("9.99"),
        b"raw-bytes",
        float("nan"),
        object(),
    ],
    ids=["datetime", "decimal", "bytes", "nan", "object"],
)
@BROKER_SIDE_ONLY
def test_non_json_argument_fails_at_publish_and_nothing_is_published(
    sng: Singletons, value: Any
) -> None:
    task = sng.task("singleton.record")
    sng.broker.delete(PARKED_QUEUE)
    backlog = broker_backlog(sng.broker)
    with pytest.raises(ArgumentsNotSerializable):
        task.apply_async(args=[value], queue=PARKED_QUEUE)
    with pytest.raises(ArgumentsNotSerializable):
        task.apply_async(kwargs={"job_id": value}, queue=PARKED_QUEUE)
    assert sng.broker.llen(PARKED_QUEUE) == 0
    assert broker_backlog(sng.broker) == backlog
    # The same publish with a JSON argument does reach the parked queue: the check can see it.
    task.apply_async(args=[sng.job()], queue=PARKED_QUEUE)
    assert sng.broker.llen(PARKED_QUEUE) == 1
    sng.broker.delete(PARKED_QUEUE)
