"""A SIGKILLed worker's jobs on the Redis broker: a @singleton_task job comes back within about
two lease TTLs, its task's own (the workers' custody records and sweep); a plain Celery task on
the same fleet waits for the visibility timeout. A message put back for a paused holder is a
new delivery: the holder's late ack leaves it, and a later crash of its new holder loses
nothing."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from celery import Celery

from tests.integration.apps.common import app_env, make_app
from tests.integration.celery_fleet import Fleet, FleetFactory
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.crash_app"
TTL = 2.0
VISIBILITY_TIMEOUT = 120.0  # far beyond the window: only custody can bring a message back
#: The promise is about two TTLs from the kill to the effect; the rest is slack for a loaded
#: two-core machine (the measured times are printed).
WINDOW = 2 * TTL + 6.0
DEFAULT_TTL = 30.0  # JOBFENCE_DEFAULT_TTL where the task declares its own `ttl=TTL`


@dataclass
class Crash:
    fleet: Fleet
    app: Celery
    ledger: Ledger
    broker: redis.Redis

    def kill_the_worker_running(self, job: str, task_id: str) -> tuple[int, float]:
        """SIGKILL the main process of the worker whose body of `job` has started (its pool
        dies with it); returns the worker's index and the time of the kill."""
        (pid,) = self.fleet.wait_executing(task_id, count=1, timeout=20.0)
        wait_for(lambda: self.ledger.start_count(job) >= 1, 20.0, message=lambda: self.explain(job))
        index = self.fleet.worker_of(pid)
        assert index is not None
        killed_at = time.time()
        self.fleet.kill_worker(index)
        return index, killed_at

    def explain(self, job: str) -> str:
        return f"{self.ledger.summary(job)}\n{self.fleet.logs(lines=20)}"


def crash_fleet(
    server: RedisServer, fleet_factory: FleetFactory, *, db: int, **extra: str
) -> Iterator[Crash]:
    """A fleet of two workers on `server`: broker on `db`, ledger and locks on the next two."""
    base = f"redis://{server.host}:{server.port}"
    env = app_env(
        f"{base}/{db}",
        ledger_url=f"{base}/{db + 1}",
        visibility_timeout=VISIBILITY_TIMEOUT,
        LOCK_URL=f"{base}/{db + 2}",
        **extra,
    )
    fleet = fleet_factory(APP, env=env, workers=2, concurrency=2)
    app = make_app("crash-client", env)
    ledger = Ledger.from_url(f"{base}/{db + 1}")
    try:
        yield Crash(fleet, app, ledger, redis.Redis(server.host, server.port, db=db))
    finally:
        ledger.close()
        app.close()


def running(crash: Crash) -> Iterator[Crash]:
    """A running fleet and an empty broker; afterwards the killed worker is restarted."""
    crash.fleet.ensure_running()
    yield crash
    crash.fleet.stop(timeout=2.0)  # a plain message left unacked must not leak on
    crash.broker.flushdb()


@pytest.fixture(scope="module")
def crash_module(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[Crash]:
    yield from crash_fleet(module_redis, fleet_factory, db=0, LEASE_TTL=repr(TTL))


@pytest.fixture
def crash(crash_module: Crash) -> Iterator[Crash]:
    yield from running(crash_module)


@pytest.fixture(scope="module")
def short_task_module(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[Crash]:
    """Default lease TTL 30 s; the gated tasks declare `ttl=` 2 s."""
    yield from crash_fleet(
        module_redis, fleet_factory, db=3, LEASE_TTL=repr(DEFAULT_TTL), TASK_TTL=repr(TTL)
    )


@pytest.fixture
def short_task(short_task_module: Crash) -> Iterator[Crash]:
    yield from running(short_task_module)


def test_a_killed_workers_singleton_job_runs_again_within_two_ttls(crash: Crash) -> None:
    job = f"job-{uuid.uuid4().hex[:12]}"
    task_id = str(crash.app.send_task("crash.fenced", args=[job]).id)
    index, killed_at = crash.kill_the_worker_running(job, task_id)
    crash.ledger.release(job)  # the copy that comes back runs through
    wait_for(
        lambda: crash.ledger.effect_count(job) >= 1,
        WINDOW,
        interval=0.05,
        message=lambda: crash.explain(job),
    )
    (effect,) = crash.ledger.effects(job)
    took = effect["t"] - killed_at
    print(f"jobfence, Redis broker: SIGKILL to effect {took:.2f}s (TTL {TTL:g}s)")
    assert effect["worker"].split("@")[0] != f"w{index}"  # the surviving worker ran it
    assert effect["task_id"] == task_id
    starts = crash.ledger.starts(job)
    assert len(starts) == 2, crash.explain(job)
    time.sleep(TTL)  # nothing more comes of it: one effect
    assert crash.ledger.effect_count(job) == 1


@pytest.fixture(scope="module", params=["start", "unique_for=10"])
def lifetime_module(
    request: pytest.FixtureRequest, module_redis: RedisServer, fleet_factory: FleetFactory
) -> Iterator[Crash]:
    """The gated tasks declared with a per-run lifetime (``lock_until="start"``, ``unique_for``)."""
    db = 9 if request.param == "start" else 12
    yield from crash_fleet(
        module_redis, fleet_factory, db=db, LEASE_TTL=repr(TTL), LIFETIME=request.param
    )


@pytest.fixture
def per_run(lifetime_module: Crash) -> Iterator[Crash]:
    yield from running(lifetime_module)


def test_a_killed_workers_per_run_job_runs_again_once_within_two_ttls(per_run: Crash) -> None:
    """Under a per-run lifetime the copy that comes back is the same run (its task id): it
    runs once, as under the default (the delivery policy page's table)."""
    crash = per_run
    job = f"job-{uuid.uuid4().hex[:12]}"
    task_id = str(crash.app.send_task("crash.fenced", args=[job]).id)
    index, killed_at = crash.kill_the_worker_running(job, task_id)
    crash.ledger.release(job)
    wait_for(
        lambda: crash.ledger.effect_count(job) >= 1,
        WINDOW,
        interval=0.05,
        message=lambda: crash.explain(job),
    )
    (effect,) = crash.ledger.effects(job)
    print(f"per-run lifetime: SIGKILL to effect {effect['t'] - killed_at:.2f}s")
    assert effect["worker"].split("@")[0] != f"w{index}"
    assert effect["task_id"] == task_id
    time.sleep(TTL)  # nothing more comes of it: one effect
    assert crash.ledger.effect_count(job) == 1, crash.explain(job)


def test_control_a_killed_workers_plain_task_does_not_come_back_in_the_window(
    crash: Crash,
) -> None:
    job = f"job-{uuid.uuid4().hex[:12]}"
    task_id = str(crash.app.send_task("crash.plain", args=[job]).id)
    _, killed_at = crash.kill_the_worker_running(job, task_id)
    crash.ledger.release(job)
    deadline = killed_at + WINDOW
    while time.time() < deadline:  # the whole window, watched
        assert crash.ledger.effect_count(job) == 0, crash.explain(job)
        time.sleep(0.1)
    # Still in kombu's unacked hash, until the visibility timeout (120 s here, 1 h by default).
    held = [json.loads(v)[0]["headers"]["id"] for v in crash.broker.hvals("unacked")]
    assert task_id in held
    assert crash.ledger.start_count(job) == 1


def test_a_killed_workers_job_comes_back_after_its_tasks_ttl_not_the_default(
    short_task: Crash,
) -> None:
    """Issue 29, defect 9: custody's deadline is the task's own `ttl=` (2 s), not the 30 s
    default; the bound lies halfway between, far from both."""
    crash = short_task
    job = f"job-{uuid.uuid4().hex[:12]}"
    task_id = str(crash.app.send_task("crash.fenced", args=[job]).id)
    _, killed_at = crash.kill_the_worker_running(job, task_id)
    crash.ledger.release(job)
    bound = (TTL + DEFAULT_TTL) / 2
    wait_for(
        lambda: crash.ledger.effect_count(job) >= 1,
        bound,
        interval=0.05,
        message=lambda: crash.explain(job),
    )
    (effect,) = crash.ledger.effects(job)
    print(f"task ttl {TTL:g}s, default {DEFAULT_TTL:g}s: SIGKILL to effect "
          f"{effect['t'] - killed_at:.2f}s")  # fmt: skip
    assert effect["task_id"] == task_id


def unacked_tag(broker: redis.Redis, task_id: str) -> str | None:
    """The delivery tag under which `task_id`'s message is unacked now, if it is."""
    for tag, raw in broker.hgetall("unacked").items():
        if json.loads(raw)[0]["headers"]["id"] == task_id:
            return str(tag.decode())
    return None


def custody_lists(broker: redis.Redis, index: int, main: int, tag: str) -> bool:
    """True if the custody record of worker `index`'s main process `main` lists `tag`."""
    for key in broker.scan_iter(match="*:custody:*"):
        for field, value in broker.hgetall(key).items():
            name = field.decode()
            if name.startswith(f"w{index}@") and name.endswith(f":{main}"):
                tokens = value.decode().split()[1:]  # main: bare tags; now: tag=deadline
                return tag in {token.split("=")[0] for token in tokens}
    return False


@dataclass
class Superseded:
    """Issue 29, defect 1's scenario, up to the crash: what it saw."""

    job: str
    task_id: str
    a: int  # the holder paused past its TTL, then superseded
    b: int  # the holder of the put-back copy, whose pool child was then killed
    old_tag: str
    new_tag: str | None


def pause_supersede_then_crash(crash: Crash) -> Superseded:
    """A is paused past its TTL, custody puts its message back, B runs it; A resumes, ends
    superseded and acks; then B's pool child is SIGKILLed mid-body and the job released."""
    fleet, broker = crash.fleet, crash.broker
    job = f"job-{uuid.uuid4().hex[:12]}"
    task_id = str(crash.app.send_task("crash.checked", args=[job]).id)
    (pid,) = fleet.wait_executing(task_id, count=1, timeout=20.0)
    wait_for(lambda: crash.ledger.start_count(job) >= 1, 20.0, message=lambda: crash.explain(job))
    a = fleet.worker_of(pid)
    assert a is not None
    b = 1 - a
    old_tag = unacked_tag(broker, task_id)
    assert old_tag is not None
    main = fleet.main_pid(a)
    stopped = [main, *fleet.child_pids(a)]
    for p in stopped:  # the whole worker: its custody record and its lease lapse
        fleet.pause(p)
    wait_for(lambda: crash.ledger.start_count(job) >= 2, 30.0, message=lambda: crash.explain(job))
    (b_child,) = wait_for(
        lambda: [p for p in fleet.executing_pids(task_id) if fleet.worker_of(p) == b],
        20.0,
        message=lambda: crash.explain(job),
    )
    new_tag = unacked_tag(broker, task_id)
    for p in reversed(stopped):
        fleet.resume(p)
    # A's body meets its lost lease, the delivery ends superseded and A acks what it holds.
    wait_for(
        lambda: any(e.kind == "postrun" and e.worker == a for e in fleet.events(task_id)),
        30.0,
        message=lambda: crash.explain(job),
    )

    def acked() -> bool:
        if new_tag == old_tag:  # put back under A's tag (the defect): A's ack removes the entry
            return not broker.hexists("unacked", old_tag)
        return not custody_lists(broker, a, main, old_tag)  # A's custody drops what it acked

    wait_for(acked, 30.0, message=lambda: crash.explain(job))
    assert "superseded by a newer holder" in fleet.log_tail(a, lines=40)
    fleet.kill_child(b_child)  # B's pool child dies mid-body (OOM, hard time limit)
    crash.ledger.release(job)
    return Superseded(job, task_id, a, b, old_tag, new_tag)


@pytest.mark.fault
def test_a_paused_holders_late_ack_spares_the_put_back_copy_and_its_crash_loses_nothing(
    crash: Crash,
) -> None:
    """Issue 29, defect 1: the put-back copy is a delivery of its own; after A's late ack and
    B's crash the job still runs."""
    seen = pause_supersede_then_crash(crash)
    job = seen.job
    wait_for(
        lambda: crash.ledger.effect_count(job) >= 1,
        60.0,
        interval=0.1,
        message=lambda: f"the job was lost\n{crash.explain(job)}",
    )
    assert crash.ledger.effect_count(job) == 1
    assert crash.ledger.effects(job)[0]["task_id"] == seen.task_id
    b_starts = [s for s in crash.ledger.starts(job) if s["worker"].startswith(f"w{seen.b}@")]
    assert b_starts, crash.explain(job)  # B ran the put-back copy
    assert seen.new_tag not in (None, seen.old_tag)  # ... as a delivery of its own


@pytest.fixture(scope="module")
def naive_module(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[Crash]:
    """Custody puts a message back under its old tag, as before issue 29 (the control)."""
    yield from crash_fleet(
        module_redis, fleet_factory, db=6, LEASE_TTL=repr(TTL), NAIVE_PUT_BACK="1"
    )


@pytest.fixture
def naive(naive_module: Crash) -> Iterator[Crash]:
    yield from running(naive_module)


@pytest.mark.fault
def test_control_a_put_back_under_the_old_tag_loses_the_job_to_the_late_ack(
    naive: Crash,
) -> None:
    seen = pause_supersede_then_crash(naive)
    assert seen.new_tag == seen.old_tag
    fleet, broker = naive.fleet, naive.broker
    # B's worker sees its child die and requeues the copy by its tag: nothing is left to requeue.
    wait_for(
        lambda: "WorkerLostError" in fleet.log_tail(seen.b, lines=40),
        30.0,
        message=lambda: naive.explain(seen.job),
    )
    deadline = time.time() + 3 * TTL  # the whole window in which the fix's copy comes back
    while time.time() < deadline:
        assert naive.ledger.effect_count(seen.job) == 0
        time.sleep(0.1)
    queued = [json.loads(m)["headers"]["id"] for m in broker.lrange("celery", 0, -1)]
    assert seen.task_id not in queued
    assert unacked_tag(broker, seen.task_id) is None  # nowhere for custody or kombu to find
    assert not fleet.executing_pids(seen.task_id)
