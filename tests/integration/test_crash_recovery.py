"""A SIGKILLed worker's jobs on the Redis broker: a @singleton_task job comes back within about
two lease TTLs (the workers' custody records and sweep); a plain Celery task on the same fleet
waits for the visibility timeout."""

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


@pytest.fixture(scope="module")
def crash_module(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[Crash]:
    base = f"redis://{module_redis.host}:{module_redis.port}"
    env = app_env(
        f"{base}/0",
        ledger_url=f"{base}/1",
        visibility_timeout=VISIBILITY_TIMEOUT,
        LOCK_URL=f"{base}/2",
        LEASE_TTL=repr(TTL),
    )
    fleet = fleet_factory(APP, env=env, workers=2, concurrency=2)
    app = make_app("crash-client", env)
    ledger = Ledger.from_url(f"{base}/1")
    try:
        yield Crash(fleet, app, ledger, module_redis.client())
    finally:
        ledger.close()
        app.close()


@pytest.fixture
def crash(crash_module: Crash) -> Iterator[Crash]:
    """A running fleet and an empty broker; afterwards the killed worker is restarted."""
    crash_module.fleet.ensure_running()
    yield crash_module
    crash_module.fleet.stop(timeout=2.0)  # a plain message left unacked must not leak on
    crash_module.broker.flushdb()


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
