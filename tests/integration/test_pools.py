"""Prefork, threads and solo workers keep leases alive by heartbeat; warm shutdown leaves none."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from jobfence.locks.backend import LockBackend, LockInfo
from jobfence.tasks import DuplicateSkipped, runtime_for
from tests.integration.apps import pool_app
from tests.integration.apps.common import app_env
from tests.integration.celery_fleet import POOLS, Fleet, FleetFactory, broker_backlog
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.pool_app"
HOLD = pool_app.HOLD_TASK
LEASE_TTL = 1.0
#: Every held lease is watched until, by the lock server's clock, it has outlived its TTL
#: this often: without heartbeats it would be gone after one TTL (``inspect`` -> None).
HELD_FOR = 3 * LEASE_TTL
#: Distinct heartbeats a watched lease must show (the keeper extends every TTL/3: ~9 in 3 TTLs).
MIN_BEATS = 6
#: Longer than any test: the broker never redelivers, so every other delivery is one we sent.
VISIBILITY_TIMEOUT = 60.0
GATE_TIMEOUT = 30.0
LEDGER_DB, LOCK_DB, RESULT_DB = 1, 2, 3
#: One broker database per fleet, so a fleet's queue and unacked messages are its own.
BROKER_DBS = {
    ("busy", "prefork"): 4,
    ("busy", "threads"): 5,
    ("busy", "solo"): 6,
    ("shutdown", "prefork"): 7,
    ("shutdown", "threads"): 8,
    ("shutdown", "solo"): 9,
}


@dataclass
class PoolFleet:
    """A fleet of one pool kind, with a publishing client on its own broker database."""

    pool: str
    fleet: Fleet
    app: Celery
    broker: redis.Redis
    ledger: Ledger
    jobs: list[str] = field(default_factory=list)

    @property
    def backend(self) -> LockBackend:
        return runtime_for(self.app).backend

    def job(self) -> str:
        job_id = f"{self.pool}-{uuid.uuid4().hex[:10]}"
        self.jobs.append(job_id)
        return job_id

    def hold(self, job_id: str, **options: Any) -> AsyncResult:
        return self.app.tasks[HOLD].apply_async(args=[job_id, GATE_TIMEOUT], **options)

    def key(self, job_id: str) -> str:
        key: str = self.app.tasks[HOLD].identity([job_id, GATE_TIMEOUT], {})[0]
        return key

    def started(self, job_id: str) -> dict[str, Any]:
        """Wait for the body of ``job_id`` to start; returns its start record."""
        wait_for(
            lambda: self.ledger.start_count(job_id) >= 1,
            15.0,
            interval=0.02,
            message=lambda: self.explain(job_id),
        )
        return self.ledger.starts(job_id)[0]

    def outcome(self, job_id: str, task_id: str, timeout: float = 10.0) -> dict[str, Any]:
        found = wait_for(
            lambda: self.ledger.outcomes(job_id, task_id),
            timeout,
            interval=0.02,
            message=lambda: f"no outcome for {task_id}\n{self.explain(job_id)}",
        )
        return found[0]

    def body_processes(self) -> set[int]:
        """Pids that may run a body: pool children (prefork) or the main processes."""
        if self.pool == "prefork":
            return {p for i in range(self.fleet.size) for p in self.fleet.child_pids(i)}
        return set(self.fleet.main_pids())

    def explain(self, job_id: str) -> str:
        starts = "\n".join(str(s) for s in self.ledger.starts(job_id))
        outcomes = "\n".join(str(o) for o in self.ledger.outcomes(job_id))
        return (
            f"{self.ledger.summary(job_id)}\nstarts:\n{starts}\noutcomes:\n{outcomes}\n"
            f"{self.fleet.logs(lines=20)}"
        )


@dataclass
class LeaseWatch:
    """``inspect`` samples of one lease, taken while its body runs."""

    key: str
    fence: int
    samples: list[LockInfo | None] = field(default_factory=list)

    def held(self) -> list[LockInfo]:
        return [s for s in self.samples if s is not None]

    def beats(self) -> list[float]:
        return sorted({s.last_heartbeat for s in self.held()})

    def held_for(self) -> float:
        """Server-clock seconds from the grant to the latest heartbeat seen."""
        held = self.held()
        return held[-1].last_heartbeat - held[-1].acquired_at if held else 0.0

    def done(self, held_for: float, beats: int) -> bool:
        return self.held_for() >= held_for and len(self.beats()) >= beats

    def assert_kept(self, pid: int, held_for: float = HELD_FOR, beats: int = MIN_BEATS) -> None:
        """Held at every sample, by ``pid``, under one fence, extended again and again."""
        gone = [i for i, s in enumerate(self.samples) if s is None]
        assert not gone, f"lease {self.key} vanished at sample {gone[0]} of {len(self.samples)}"
        held = self.held()
        assert {s.fence for s in held} == {self.fence}, {s.fence for s in held}
        assert {s.pid for s in held} == {pid}, {s.pid for s in held}
        assert min(s.ttl_left for s in held) > 0, [s.ttl_left for s in held]
        seen = [s.last_heartbeat for s in held]
        assert seen == sorted(seen), "last_heartbeat went backwards"
        assert len(self.beats()) >= beats, self.beats()
        assert self.held_for() >= held_for, self.held_for()


def watch(
    backend: LockBackend,
    leases: Sequence[tuple[str, int]],
    *,
    held_for: float = HELD_FOR,
    beats: int = MIN_BEATS,
) -> list[LeaseWatch]:
    """Sample every ``(key, fence)`` until each was held ``held_for`` s and showed ``beats``
    heartbeats, one of them vanished, or a deadline passed (the assertions tell which)."""
    watches = [LeaseWatch(key, fence) for key, fence in leases]

    def enough() -> bool:
        for w in watches:
            w.samples.append(backend.inspect(w.key))
        if any(w.samples[-1] is None for w in watches):
            return True
        return all(w.done(held_for, beats) for w in watches)

    with contextlib.suppress(AssertionError):  # too few heartbeats: assert_kept says so
        wait_for(enough, held_for + 10.0, interval=0.05)
    return watches


def broker_task_ids(broker: redis.Redis) -> tuple[list[str], list[str]]:
    """Task ids of the messages in the ``celery`` queue, and of those delivered but unacked."""
    queued = [json.loads(raw)["headers"]["id"] for raw in broker.lrange("celery", 0, -1)]
    unacked = [json.loads(raw)[0]["headers"]["id"] for raw in broker.hvals("unacked")]
    return queued, unacked


# -- fixtures --------------------------------------------------------------------------------


@dataclass
class _Stack:
    server: str
    factory: FleetFactory
    ledger: Ledger
    apps: list[Celery] = field(default_factory=list)
    fleets: dict[tuple[str, str], PoolFleet] = field(default_factory=dict)

    def fleet(self, purpose: str, pool: str, *, workers: int, concurrency: int) -> PoolFleet:
        """The started fleet for (``purpose``, ``pool``), made on first use."""
        made = self.fleets.get((purpose, pool))
        if made is not None:
            return made
        env = app_env(
            f"{self.server}/{BROKER_DBS[purpose, pool]}",
            ledger_url=f"{self.server}/{LEDGER_DB}",
            visibility_timeout=VISIBILITY_TIMEOUT,
            LOCK_URL=f"{self.server}/{LOCK_DB}",
            RESULT_BACKEND=f"{self.server}/{RESULT_DB}",
            LEASE_TTL=repr(LEASE_TTL),
            LOCK_SOCKET_TIMEOUT="0.5",
        )
        fleet = self.factory(APP, env=env, workers=workers, concurrency=concurrency, pool=pool)
        app = pool_app.create_app(env, name=f"pool-client-{purpose}-{pool}")
        self.apps.append(app)
        broker = redis.Redis.from_url(env["BROKER_URL"])
        made = self.fleets[purpose, pool] = PoolFleet(pool, fleet, app, broker, self.ledger)
        return made


@pytest.fixture(scope="module")
def stack(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[_Stack]:
    server = f"redis://{module_redis.host}:{module_redis.port}"
    s = _Stack(server, fleet_factory, Ledger.from_url(f"{server}/{LEDGER_DB}"))
    try:
        yield s
    finally:
        for made in s.fleets.values():
            for job_id in made.jobs:
                s.ledger.release(job_id)
            made.broker.close()
        s.ledger.close()
        for app in s.apps:
            runtime_for(app).close()
            app.close()


@pytest.fixture
def busy(stack: _Stack, request: pytest.FixtureRequest) -> Iterator[PoolFleet]:
    """A running fleet of pool ``request.param`` with two free slots; afterwards, idle again."""
    pool: str = request.param
    # solo runs one task per worker: the second slot, for the duplicate, is a second worker.
    workers, concurrency = (2, 1) if pool == "solo" else (1, 2)
    made = stack.fleet("busy", pool, workers=workers, concurrency=concurrency)
    yield made
    for job_id in made.jobs:
        stack.ledger.release(job_id)
    made.fleet.wait_idle(made.broker, timeout=20.0)


# -- heartbeats while a body runs ------------------------------------------------------------


@pytest.mark.parametrize("busy", POOLS, indirect=True)
def test_lease_is_kept_while_a_body_outlives_its_ttl_and_a_duplicate_is_refused(
    busy: PoolFleet,
) -> None:
    job = busy.job()
    key = busy.key(job)
    holder = busy.hold(job)
    start = busy.started(job)
    pid, fence = start["pid"], start["fence"]
    assert pid in busy.body_processes(), (pid, busy.fleet.describe())
    assert start["keepers"] == 1, start  # one keeper thread in the process running the body
    if busy.pool != "threads":
        # Every prefork child (and solo worker) ran its keeper from worker_process_init on,
        # before it held any lease; the threads pool sends no such signal (first lease starts it).
        def inits() -> dict[int, int]:
            return {r["pid"]: r["keepers"] for r in pool_app.process_inits(busy.ledger)}

        wait_for(
            lambda: all(inits().get(p) == 1 for p in busy.body_processes()),
            10.0,
            message=lambda: f"{inits()} {busy.fleet.describe()}",
        )
    duplicate = busy.hold(job)  # the same job again, while the body runs

    (lease,) = watch(busy.backend, [(key, fence)])
    lease.assert_kept(pid)

    # The duplicate ran beside the body's delivery and stopped as one.
    dup = busy.outcome(job, duplicate.id)
    assert (dup["state"], dup.get("error")) == ("FAILURE", "DuplicateSkipped"), busy.explain(job)
    assert busy.ledger.end_count(job) == 0, "the body should still be at its gate"
    busy.ledger.release(job)
    assert holder.get(timeout=15.0) == {"job": job, "fence": fence, "pid": pid, "effects": 1}
    with pytest.raises(DuplicateSkipped):
        duplicate.get(timeout=5.0)
    busy.fleet.wait_idle(busy.broker)
    assert busy.ledger.start_count(job) == 1, busy.explain(job)
    assert busy.ledger.effect_count(job) == 1, busy.explain(job)
    assert busy.ledger.max_concurrent(job) == 1, busy.explain(job)
    record = busy.backend.job_record(key)
    assert record is not None and record.state == "DONE" and record.fence == fence, record
    assert busy.backend.inspect(key) is None


@pytest.mark.parametrize("busy", ["threads"], indirect=True)
def test_one_keeper_thread_extends_two_leases_of_a_threads_worker(busy: PoolFleet) -> None:
    jobs = [busy.job(), busy.job()]
    results = [busy.hold(job) for job in jobs]
    starts = [busy.started(job) for job in jobs]
    (pid,) = {s["pid"] for s in starts}  # one worker process ...
    assert starts[0]["thread"] != starts[1]["thread"]  # ... two pool threads ...
    assert [s["keepers"] for s in starts] == [1, 1]  # ... one keeper thread
    leases = [(busy.key(job), s["fence"]) for job, s in zip(jobs, starts, strict=True)]

    watches = watch(busy.backend, leases)
    for w in watches:
        w.assert_kept(pid)
    # One extend_many call stamps every lease it extends with the same server time: most
    # heartbeats of the two leases were one round trip.
    shared = set(watches[0].beats()) & set(watches[1].beats())
    assert len(shared) >= MIN_BEATS // 2, (watches[0].beats(), watches[1].beats())

    for job in jobs:
        busy.ledger.release(job)
    for job, result, (key, fence) in zip(jobs, results, leases, strict=True):
        assert result.get(timeout=15.0) == {"job": job, "fence": fence, "pid": pid, "effects": 1}
        record = busy.backend.job_record(key)
        assert record is not None and record.state == "DONE" and record.fence == fence
    busy.fleet.wait_idle(busy.broker)
    assert list(busy.backend.scan()) == []


# -- warm shutdown ---------------------------------------------------------------------------


@pytest.mark.parametrize("pool", POOLS)
def test_warm_shutdown_finishes_the_running_job_and_leaves_no_lease(
    stack: _Stack, pool: str
) -> None:
    made = stack.fleet("shutdown", pool, workers=1, concurrency=1)
    running, queued = made.job(), made.job()
    keys = {job: made.key(job) for job in (running, queued)}
    first = made.hold(running)
    start = made.started(running)
    pid, fence = start["pid"], start["fence"]
    assert pid in made.body_processes(), (pid, made.fleet.describe())
    # The only slot is busy: the second job waits in the broker, not started.
    second = made.hold(queued)
    assert broker_task_ids(made.broker) == ([second.id], [first.id])

    worker = made.fleet.begin_warm_shutdown(0)
    wait_for(
        lambda: made.fleet.shutting_down(0),
        10.0,
        message=lambda: made.fleet.logs(lines=20),
    )
    # Shutting down, the worker keeps the running job's lease alive for as long as it runs:
    # four heartbeats seen after the signal are three extensions, a full TTL, during shutdown.
    (lease,) = watch(made.backend, [(keys[running], fence)], held_for=2 * LEASE_TTL, beats=4)
    lease.assert_kept(pid, held_for=2 * LEASE_TTL, beats=4)
    assert not worker.exited, "the worker left before its running task finished"
    made.ledger.release(running)

    wait_for(lambda: worker.exited, 20.0, message=lambda: made.fleet.logs(lines=30))
    assert worker.exit_status() == 0, made.fleet.logs(lines=30)
    if pool == "prefork":
        assert not made.fleet.owns(pid), "the pool child outlived its worker"
    # The running job finished: its DONE record is stored, its effect happened once.
    assert made.ledger.effect_count(running) == 1, made.explain(running)
    assert made.ledger.end_count(running) == 1, made.explain(running)
    record = made.backend.job_record(keys[running])
    assert record is not None and record.state == "DONE" and record.fence == fence, record
    assert json.loads(record.result) == {"job": running, "fence": fence, "pid": pid, "effects": 1}
    assert first.get(timeout=5.0) == json.loads(record.result)
    # The queued job never started: no lease, no record, and its message is still queued.
    assert made.ledger.start_count(queued) == 0, made.explain(queued)
    assert made.backend.job_record(keys[queued]) is None
    # The finished task was acked; the queued one is still queued, for the next worker.
    assert broker_task_ids(made.broker) == ([second.id], []), broker_backlog(made.broker)
    # Nothing is left held: not the finished job's lease, not the queued one's.
    for key in keys.values():
        assert made.backend.inspect(key) is None
    assert list(made.backend.scan()) == []
