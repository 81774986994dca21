"""Control runs: with plain Celery tasks every duplicate delivery really runs the body again."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from celery import Celery

from tests.integration.apps.common import app_env, make_app
from tests.integration.celery_fleet import Fleet, FleetFactory
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.control_app"
VISIBILITY_TIMEOUT = 2.0
RESTORE_INTERVAL = 0.5
#: Longest a message can stay invisible after its consumer stopped acking: the timeout,
#: one sweep period, and slack for a loaded two-core machine.
REDELIVERY_DEADLINE = VISIBILITY_TIMEOUT + RESTORE_INTERVAL + 8.0


@dataclass
class Controls:
    """What a control test needs: the fleet, a publishing client, the ledger, the broker."""

    fleet: Fleet
    app: Celery
    ledger: Ledger
    broker: redis.Redis
    jobs: list[str] = field(default_factory=list)

    def job(self) -> str:
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        self.jobs.append(job_id)
        return job_id

    def send(self, name: str, *args: Any, **options: Any) -> str:
        return str(self.app.send_task(name, args=list(args), **options).id)

    def explain(self, job_id: str) -> str:
        starts = "\n".join(str(s) for s in self.ledger.starts(job_id))
        return f"{self.ledger.summary(job_id)}\nstarts:\n{starts}\n{self.fleet.logs(lines=15)}"


@dataclass
class _Module:
    fleet: Fleet
    server: RedisServer
    app: Celery
    ledger: Ledger
    broker: redis.Redis


@pytest.fixture(scope="module")
def control_module(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[_Module]:
    ledger_url = f"redis://{module_redis.host}:{module_redis.port}/1"
    env = app_env(
        module_redis.url,
        ledger_url=ledger_url,
        visibility_timeout=VISIBILITY_TIMEOUT,
        restore_interval=RESTORE_INTERVAL,
    )
    fleet = fleet_factory(APP, env=env, workers=2, concurrency=2)
    app = make_app("control-client", env)
    ledger = Ledger.from_url(ledger_url)
    try:
        yield _Module(fleet, module_redis, app, ledger, module_redis.client())
    finally:
        ledger.close()
        app.close()


@pytest.fixture
def ctl(control_module: _Module) -> Iterator[Controls]:
    """A healthy, idle fleet and an empty ledger; afterwards, gates opened and the fleet idle."""
    m = control_module
    m.fleet.ensure_running()
    m.ledger.reset()
    controls = Controls(m.fleet, m.app, m.ledger, m.broker)
    yield controls
    for job_id in controls.jobs:
        m.ledger.release(job_id)
    try:
        m.fleet.wait_idle(m.broker, timeout=15.0)
    except AssertionError:
        # Left-overs would leak into the next test: start over from an empty broker.
        m.fleet.stop(timeout=2.0)
        m.broker.flushall()
        m.fleet.start()


def test_same_job_published_1000_times_runs_1000_times(ctl: Controls) -> None:
    job = ctl.job()
    started = time.monotonic()
    with ctl.app.producer_or_acquire() as producer:
        for _ in range(1000):
            ctl.app.send_task("control.record", args=[job], producer=producer)
    wait_for(
        lambda: ctl.ledger.effect_count(job) >= 1000,
        60.0,
        interval=0.05,
        message=lambda: ctl.explain(job),
    )
    ctl.fleet.wait_idle(ctl.broker)
    elapsed = time.monotonic() - started
    starts = ctl.ledger.starts(job)
    assert ctl.ledger.effect_count(job) >= 1000, ctl.ledger.summary(job)
    assert len(starts) == ctl.ledger.effect_count(job)
    # Both workers took part, so "ran 1,000 times" is not one process replaying a loop.
    assert {s["worker"].split("@")[0] for s in starts} == {"w0", "w1"}, elapsed


def test_countdown_longer_than_visibility_timeout_runs_more_than_once(ctl: Controls) -> None:
    job = ctl.job()
    countdown = 2.5 * VISIBILITY_TIMEOUT
    sent = time.time()
    ctl.send("control.record", job, countdown=countdown)
    # The worker holding the ETA message never acks it before the ETA, so the sweep puts it
    # back every visibility timeout and another consumer takes a second copy.
    wait_for(
        lambda: ctl.ledger.effect_count(job) >= 2,
        countdown + REDELIVERY_DEADLINE,
        interval=0.05,
        message=lambda: ctl.explain(job),
    )
    ctl.fleet.wait_idle(ctl.broker)
    starts = ctl.ledger.starts(job)
    assert ctl.ledger.effect_count(job) >= 2, ctl.explain(job)
    assert all(s["t"] >= sent + countdown - 0.5 for s in starts), "ran before its ETA"
    assert any(s["redelivered"] for s in starts), ctl.explain(job)
    assert len({s["task_id"] for s in starts}) == 1  # one message, several executions


def test_task_longer_than_visibility_timeout_overlaps_its_redelivered_copy(
    ctl: Controls,
) -> None:
    job = ctl.job()
    task_id = ctl.send("control.gated", job, 30.0)
    first = ctl.fleet.wait_executing(task_id, count=1)
    # Still running (blocked at the gate) past the visibility timeout: a copy runs beside it.
    wait_for(
        lambda: ctl.ledger.max_concurrent(job) >= 2,
        REDELIVERY_DEADLINE,
        interval=0.05,
        message=lambda: ctl.explain(job),
    )
    both = ctl.fleet.executing_pids(task_id)
    assert first[0] in both and len(both) >= 2, (first, both)
    ctl.ledger.release(job)
    wait_for(
        lambda: ctl.ledger.end_count(job) >= ctl.ledger.start_count(job) >= 2,
        10.0,
        message=lambda: ctl.explain(job),
    )
    ctl.fleet.wait_idle(ctl.broker)
    starts = ctl.ledger.starts(job)
    assert ctl.ledger.effect_count(job) >= 2, ctl.explain(job)
    assert starts[0]["redelivered"] is False and starts[1]["redelivered"] is True
    assert starts[1]["concurrent"] >= 2


def test_killed_child_is_redelivered_and_the_effect_happens_twice(ctl: Controls) -> None:
    job = ctl.job()
    task_id = ctl.send("control.gated", job, 30.0, True)  # effect first, then block
    (victim,) = ctl.fleet.wait_executing(task_id, count=1)
    wait_for(lambda: ctl.ledger.effect_count(job) >= 1, 10.0, message=lambda: ctl.explain(job))
    ctl.fleet.kill_child(victim)
    # acks_late + reject_on_worker_lost: the main process requeues the message once it
    # notices the loss (at once, or at its next 5 s maintain_pool tick: the pool's sentinel
    # fd is not always readable when a child dies); the visibility sweep may come first.
    wait_for(
        lambda: ctl.ledger.effect_count(job) >= 2,
        REDELIVERY_DEADLINE,
        interval=0.02,
        message=lambda: ctl.explain(job),
    )
    ctl.ledger.release(job)
    ctl.fleet.wait_idle(ctl.broker)
    starts = ctl.ledger.starts(job)
    effects = ctl.ledger.effects(job)
    assert len(effects) >= 2, ctl.explain(job)
    assert starts[0]["pid"] == victim and starts[1]["pid"] != victim
    assert starts[1]["redelivered"] is True


def test_frozen_child_outlives_visibility_timeout_and_both_copies_finish(
    ctl: Controls,
) -> None:
    job = ctl.job()
    task_id = ctl.send("control.gated", job, 30.0)
    (frozen,) = ctl.fleet.wait_executing(task_id, count=1)
    with ctl.fleet.paused(frozen):
        wait_for(
            lambda: ctl.ledger.start_count(job) >= 2,
            REDELIVERY_DEADLINE,
            interval=0.05,
            message=lambda: ctl.explain(job),
        )
        ctl.ledger.release(job)
        # The copy finishes (effect + ack) while the original is still frozen.
        wait_for(lambda: ctl.ledger.effect_count(job) >= 1, 10.0, message=lambda: ctl.explain(job))
        assert all(e["pid"] != frozen for e in ctl.ledger.effects(job))
    # Thawed, the original carries on where it stopped and has its effect too.
    wait_for(
        lambda: any(e["pid"] == frozen for e in ctl.ledger.effects(job)),
        10.0,
        message=lambda: ctl.explain(job),
    )
    ctl.fleet.wait_idle(ctl.broker)
    assert ctl.ledger.effect_count(job) >= 2, ctl.explain(job)


def test_killed_worker_main_process_job_runs_again_after_visibility_timeout(
    ctl: Controls,
) -> None:
    job = ctl.job()
    task_id = ctl.send("control.gated", job, 30.0, True)  # effect first, then block
    (pid,) = ctl.fleet.wait_executing(task_id, count=1)
    index = ctl.fleet.worker_of(pid)
    assert index is not None
    wait_for(lambda: ctl.ledger.effect_count(job) >= 1, 10.0, message=lambda: ctl.explain(job))
    ctl.fleet.kill_worker(index, with_children=True)  # the whole machine dies: nobody requeues
    # Only the surviving worker's sweep can bring the message back.
    wait_for(
        lambda: ctl.ledger.effect_count(job) >= 2,
        REDELIVERY_DEADLINE,
        interval=0.05,
        message=lambda: ctl.explain(job),
    )
    starts = ctl.ledger.starts(job)
    assert starts[1]["worker"].split("@")[0] != f"w{index}"
    assert starts[1]["redelivered"] is True
    assert starts[1]["t"] - starts[0]["t"] >= VISIBILITY_TIMEOUT - 0.1


def test_retry_of_a_naively_locked_task_is_refused_by_its_own_lock(ctl: Controls) -> None:
    job = ctl.job()
    task_id = ctl.send("control.naive_retry", job)
    # The lock taken by the first attempt is still there when its retry arrives (Celery
    # skips after_return for RETRY), so the retry gives up and the job never takes effect.
    blocked = wait_for(
        lambda: ctl.ledger.outcomes(job, task_id),
        REDELIVERY_DEADLINE,
        interval=0.02,
        message=lambda: ctl.explain(job),
    )
    ctl.fleet.wait_idle(ctl.broker)
    assert blocked[0]["blocked"] is True and blocked[0]["retries"] == 1, blocked
    starts = ctl.ledger.starts(job)
    assert len(starts) == 1 and starts[0]["retries"] == 0, ctl.explain(job)
    assert ctl.ledger.effect_count(job) == 0, ctl.explain(job)
