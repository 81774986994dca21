"""Chains, groups, chords and links on real workers: a duplicate never hands on a marker.

`workflow.head` is `@singleton_task(key=["n"], on_conflict="skip")` with a gated body. Each
test starts a first run of job n and holds it in its body, then publishes a workflow whose
head is a duplicate of it: the duplicate comes back for the running copy's result and the
steps after it get that real result (the body runs once); a bare duplicate, with no workflow
after it, stops with `DuplicateSkipped` naming the running copy. The control is a naive skip
(a `SET NX` lock that returns a marker): the next step takes the marker as its input.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group

from jobfence.tasks import DuplicateSkipped, runtime_for
from tests.integration.apps import workflow_app
from tests.integration.apps.common import app_env
from tests.integration.apps.workflow_app import NAIVE_MARKER, fail_once_key, job_id
from tests.integration.celery_fleet import Fleet, FleetFactory
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.workflow_app"
DEADLINE = 30.0  # for anything a worker must do; far above the normal second or less
_numbers = itertools.count(random.randrange(10**6, 10**7) * 100)  # fresh keys per run


@dataclass
class Workflows:
    fleet: Fleet
    app: Celery
    ledger: Ledger
    broker: redis.Redis

    def task(self, name: str) -> Any:
        return self.app.tasks[f"workflow.{name}"]

    def running(self, n: int) -> None:
        """Wait until the first run of job n is in its body (holding the job's lease)."""
        wait_for(lambda: self.ledger.start_count(job_id(n)) >= 1, DEADLINE, 0.02,
                 self.explain(n))  # fmt: skip

    def turned_away(self, task_id: str) -> None:
        """Wait until a delivery of `task_id` has ended in the worker (a duplicate, here)."""
        wait_for(lambda: any(e.kind == "postrun" for e in self.fleet.events(task_id)),
                 DEADLINE, 0.02, lambda: self.fleet.logs(lines=20))  # fmt: skip

    def received(self, n: int, step: str) -> list[Any]:
        """What each run of `step` (tail, summary) was handed for job n."""
        return [e["received"] for e in self.ledger.effects(job_id(n)) if e["step"] == step]

    def explain(self, n: int) -> Any:
        return lambda: f"{self.ledger.summary(job_id(n))}\n{self.fleet.logs(lines=20)}"


@pytest.fixture(scope="module")
def workflows_module(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[Workflows]:
    """One prefork worker (room for the held first run, its duplicate and the steps after),
    locks on Redis, and a Redis result backend, as chains and chords need."""
    server = f"redis://{module_redis.host}:{module_redis.port}"
    env = app_env(
        module_redis.url,  # broker: db 0
        ledger_url=f"{server}/1",
        LOCK_URL=f"{server}/2",
        RESULT_BACKEND=f"{server}/3",
    )
    fleet = fleet_factory(APP, env=env, workers=1, concurrency=4)
    app = workflow_app.create_app(env, name="workflow-client")
    ledger = Ledger.from_url(f"{server}/1")
    try:
        yield Workflows(fleet, app, ledger, module_redis.client())
    finally:
        ledger.close()
        runtime_for(app).close()
        app.close()


@pytest.fixture
def wf(workflows_module: Workflows) -> Iterator[Workflows]:
    m = workflows_module
    m.fleet.ensure_running()
    yield m
    # Open every gate, so no body holds a pool process into the next test.
    for key in m.ledger.client.scan_iter(match="ledger:*:starts"):
        m.ledger.release(key.decode().split(":")[1])
    m.fleet.wait_idle(m.broker)


def _first_run(wf: Workflows, n: int) -> Any:
    """Publish chain(head(n), tail) and wait until its head holds job n."""
    first = chain(wf.task("head").s(n), wf.task("tail").s(job_id(n))).apply_async()
    wf.running(n)
    return first


def _finish_first(wf: Workflows, n: int, first: Any) -> None:
    """Open the gate: the first run's chain gets the real result, its tail only that."""
    wf.ledger.release(job_id(n))
    assert first.get(timeout=DEADLINE) == n * 10
    assert wf.ledger.start_count(job_id(n)) == 1, wf.explain(n)()


def test_chain_after_a_duplicate_head_gets_the_running_copys_result(wf: Workflows) -> None:
    n = next(_numbers)
    first = _first_run(wf, n)
    second = chain(wf.task("head").s(n), wf.task("tail").s(job_id(n))).apply_async()
    wf.turned_away(second.parent.id)  # met the running copy, and went on waiting for it
    assert wf.received(n, "tail") == [] and not second.ready(), wf.explain(n)()
    _finish_first(wf, n, first)
    assert second.get(timeout=DEADLINE) == n * 10
    assert wf.received(n, "tail") == [n * 10, n * 10], wf.explain(n)()


def test_group_with_a_duplicate_gets_the_running_copys_result(wf: Workflows) -> None:
    n = next(_numbers)
    first = _first_run(wf, n)
    both = group(wf.task("head").s(n), wf.task("tail").s("other", job_id(n))).apply_async()
    wf.turned_away(both.results[0].id)
    _finish_first(wf, n, first)
    assert both.get(timeout=DEADLINE) == [n * 10, "other"]


def test_chord_with_a_duplicate_in_its_header_runs_its_body_with_the_real_result(
    wf: Workflows,
) -> None:
    n = next(_numbers)
    first = _first_run(wf, n)
    header = [wf.task("head").s(n), wf.task("tail").s("other", job_id(n))]
    body = chord(header, wf.task("summary").s(job_id(n))).apply_async()
    wf.turned_away(body.parent.results[0].id)
    assert wf.received(n, "summary") == [], wf.explain(n)()
    _finish_first(wf, n, first)
    assert body.get(timeout=DEADLINE) == [n * 10, "other"]
    assert wf.received(n, "summary") == [[n * 10, "other"]], wf.explain(n)()


def test_link_of_a_duplicate_runs_with_the_real_result_and_link_error_does_not(
    wf: Workflows,
) -> None:
    n = next(_numbers)
    first = _first_run(wf, n)
    dup = wf.task("head").apply_async(
        (n,), link=wf.task("tail").s(job_id(n)), link_error=wf.task("on_error").s(job_id(n))
    )
    wf.turned_away(dup.id)
    _finish_first(wf, n, first)
    assert dup.get(timeout=DEADLINE) == n * 10
    wait_for(lambda: len(wf.received(n, "tail")) == 2, DEADLINE, 0.02, wf.explain(n))
    assert wf.received(n, "tail") == [n * 10, n * 10], wf.explain(n)()
    assert wf.ledger.outcomes(job_id(n)) == [], "link_error ran for a duplicate"


def test_a_duplicate_whose_running_copy_failed_runs_the_job_for_its_chain(
    wf: Workflows,
) -> None:
    n = next(_numbers)
    wf.ledger.client.set(fail_once_key(n), 1)
    first = _first_run(wf, n)
    second = chain(wf.task("head").s(n), wf.task("tail").s(job_id(n))).apply_async()
    wf.turned_away(second.parent.id)
    wf.ledger.release(job_id(n))
    with pytest.raises(RuntimeError):
        first.get(timeout=DEADLINE)
    assert second.get(timeout=DEADLINE) == n * 10  # its comeback ran it, as a fresh publish
    assert wf.ledger.start_count(job_id(n)) == 2 and wf.ledger.max_concurrent(job_id(n)) == 1
    assert wf.received(n, "tail") == [n * 10], wf.explain(n)()


def test_a_bare_duplicate_stops_with_duplicate_skipped_naming_the_running_copy(
    wf: Workflows,
) -> None:
    n = next(_numbers)
    first = _first_run(wf, n)
    dup = wf.task("head").delay(n)  # no workflow after it: nothing waits for its data
    with pytest.raises(DuplicateSkipped) as caught:
        dup.get(timeout=DEADLINE)
    assert caught.value.task_id == first.parent.id
    _finish_first(wf, n, first)
    assert wf.app.AsyncResult(caught.value.task_id).get(timeout=DEADLINE) == n * 10


def test_control_a_naive_skip_hands_its_marker_to_the_next_step(wf: Workflows) -> None:
    n = next(_numbers)
    head, tail = wf.task("naive_head"), wf.task("tail")
    first = chain(head.s(n), tail.s(job_id(n))).apply_async()
    wf.running(n)
    second = chain(head.s(n), tail.s(job_id(n))).apply_async()
    assert second.get(timeout=DEADLINE) == NAIVE_MARKER  # taken as the head's result
    assert wf.received(n, "tail") == [NAIVE_MARKER], wf.explain(n)()
    wf.ledger.release(job_id(n))
    assert first.get(timeout=DEADLINE) == n * 10
