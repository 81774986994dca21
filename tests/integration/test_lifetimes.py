"""Lock lifetimes and duplicate publishes on real workers: lock_until, unique_for, replace."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery

from jobfence.tasks import DuplicatePublish, runtime_for
from tests.integration.apps import lifetime_app
from tests.integration.apps.common import app_env
from tests.integration.celery_fleet import Fleet, FleetFactory
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.lifetime_app"
# Long enough that a message held for its countdown is not handed out twice meanwhile.
VISIBILITY_TIMEOUT = 10.0
DEADLINE = 20.0  # for anything a worker must do; far above the normal second or less


@dataclass
class Lifetimes:
    fleet: Fleet
    app: Celery
    ledger: Ledger
    broker: redis.Redis

    def task(self, name: str) -> Any:
        return self.app.tasks[f"lifetime.{name}"]

    def outcome(self, job_id: str, task_id: str) -> dict[str, Any]:
        """The (first) outcome of `task_id`'s delivery, once it has one."""
        found: list[dict[str, Any]] = wait_for(
            lambda: self.ledger.outcomes(job_id, task_id), DEADLINE, 0.02, self.explain(job_id)
        )
        return found[0]

    def started(self, job_id: str, count: int = 1) -> None:
        wait_for(lambda: self.ledger.start_count(job_id) >= count, DEADLINE, 0.02,
                 self.explain(job_id))  # fmt: skip

    def explain(self, job_id: str) -> Any:
        return lambda: f"{self.ledger.summary(job_id)}\n{self.fleet.logs(lines=15)}"


@pytest.fixture(scope="module", params=["redis", "postgres", "valkey"])
def lifetimes_module(
    request: pytest.FixtureRequest, module_redis: RedisServer, fleet_factory: FleetFactory
) -> Iterator[Lifetimes]:
    """A worker whose locks and publish claims live on Redis, PostgreSQL or Valkey."""
    server = f"redis://{module_redis.host}:{module_redis.port}"
    lock_url = {
        "redis": lambda: f"{server}/2",
        "postgres": lambda: request.getfixturevalue("pg_url"),
        "valkey": lambda: request.getfixturevalue("module_valkey").url,
    }[request.param]()
    env = app_env(
        module_redis.url,  # broker: db 0
        ledger_url=f"{server}/1",
        visibility_timeout=VISIBILITY_TIMEOUT,
        LOCK_URL=lock_url,
    )
    fleet = fleet_factory(APP, env=env, workers=1, concurrency=2)
    app = lifetime_app.create_app(env, name="lifetime-client")
    ledger = Ledger.from_url(f"{server}/1")
    try:
        yield Lifetimes(fleet, app, ledger, module_redis.client())
    finally:
        ledger.close()
        runtime_for(app).close()
        app.close()
        fleet.stop()  # the next parameter's worker shares the broker: this one may not stay


@pytest.fixture
def lt(lifetimes_module: Lifetimes) -> Iterator[Lifetimes]:
    m = lifetimes_module
    m.fleet.ensure_running()
    yield m
    # Open every gate, so no body holds a pool process into the next test.
    for key in m.ledger.client.scan_iter(match="ledger:*:starts"):
        m.ledger.release(key.decode().split(":")[1])
    m.fleet.wait_idle(m.broker)


def job() -> str:
    return f"job-{uuid.uuid4().hex[:12]}"


# -- lock_until ----------------------------------------------------------------------------


def test_lock_until_start_queues_a_newer_copy_behind_the_running_one(lt: Lifetimes) -> None:
    j, task = job(), lt.task("start")
    first = task.delay(j, "v1")
    lt.started(j)
    second = task.delay(j, "v2")
    assert second.id != first.id, "the key stayed claimed after the run started"
    assert task.delay(j, "v3").id == second.id, "the queued copy's claim did not hold"
    lt.ledger.release(j)
    assert lt.outcome(j, second.id)["value"] == "v2"
    starts, ends = lt.ledger.starts(j), lt.ledger.ends(j)
    assert [s["version"] for s in starts] == ["v1", "v2"], lt.explain(j)()
    assert lt.ledger.max_concurrent(j) == 1
    assert starts[1]["t"] >= ends[0]["t"], "the newer copy ran beside the running one"


#: The controls do not depend on the lock backend: run once, on Redis locks.
ON_REDIS_ONLY = pytest.mark.parametrize("lifetimes_module", ["redis"], indirect=True)


@ON_REDIS_ONLY
def test_control_lock_until_finish_answers_a_publish_during_the_run_with_the_first(
    lt: Lifetimes,
) -> None:
    j, task = job(), lt.task("finish")
    first = task.delay(j, "v1")
    lt.started(j)
    assert task.delay(j, "v2").id == first.id
    lt.ledger.release(j)
    assert lt.outcome(j, first.id)["value"] == "v1"
    assert lt.ledger.start_count(j) == 1


@ON_REDIS_ONLY
def test_control_plain_celery_runs_both_publishes_at_once(lt: Lifetimes) -> None:
    j, task = job(), lt.task("plain")
    first, second = task.delay(j, "v1"), task.delay(j, "v2")
    assert first.id != second.id
    lt.started(j, 2)  # both bodies in, neither gate open
    assert lt.ledger.max_concurrent(j) == 2
    lt.ledger.release(j)


# -- unique_for ----------------------------------------------------------------------------


def test_unique_for_throttles_publishes_and_runs_within_the_window_and_allows_after(
    lt: Lifetimes,
) -> None:
    j, task = job(), lt.task("throttle")
    first = task.delay(j)
    assert lt.outcome(j, first.id)["value"] == 1
    finished = lt.ledger.ends(j)[0]["t"]
    assert task.delay(j).id == first.id, "a publish inside the window went out"
    # A copy published around the claim (send_task) is throttled when it runs.
    stray = lt.app.send_task("lifetime.throttle", args=[j])
    throttled = lt.outcome(j, stray.id)
    assert (throttled["state"], throttled["error"]) == ("FAILURE", "DuplicateSkipped")
    # After the window a publish goes out and runs.
    deadline = time.monotonic() + lifetime_app.UNIQUE_FOR + DEADLINE
    while (later := task.delay(j)).id == first.id:
        assert time.monotonic() < deadline, "the key stayed throttled past its window"
        time.sleep(0.05)
    assert time.time() - finished >= lifetime_app.UNIQUE_FOR * 0.9
    assert lt.outcome(j, later.id)["value"] == 2
    assert lt.ledger.start_count(j) == 2


def test_a_throttled_task_still_runs_its_own_retry(lt: Lifetimes) -> None:
    j = job()
    first = lt.task("retried").delay(j)
    wait_for(lambda: any(o["state"] == "SUCCESS" for o in lt.ledger.outcomes(j, first.id)),
             DEADLINE, 0.02, lt.explain(j))  # fmt: skip
    assert [s["retries"] for s in lt.ledger.starts(j)] == [0, 1]
    assert lt.ledger.effect_count(j) == 1


# -- on_duplicate_publish ----------------------------------------------------------------


def test_raise_names_the_task_id_of_the_copy_already_queued_or_running(lt: Lifetimes) -> None:
    j, task = job(), lt.task("raise")
    first = task.delay(j, "v1")
    with pytest.raises(DuplicatePublish, match=first.id) as caught:
        task.delay(j, "v2")
    assert caught.value.task_id == first.id and j not in str(caught.value)
    lt.ledger.release(j)
    assert lt.outcome(j, first.id)["value"] == "v1"
    assert lt.ledger.start_count(j) == 1


def test_replace_supersedes_a_copy_that_has_not_started(lt: Lifetimes) -> None:
    j, task = job(), lt.task("replace")
    lt.ledger.release(j)
    old = task.apply_async((j, "v1"), countdown=1.5)  # held by the worker until then
    new = task.delay(j, "v2")
    assert new.id != old.id
    assert lt.outcome(j, new.id)["value"] == "v2"
    # The old copy is still delivered (nothing revoked it): it finds its claim gone and skips.
    skipped = lt.outcome(j, old.id)
    assert (skipped["state"], skipped["error"]) == ("FAILURE", "JobSuperseded")
    assert [s["version"] for s in lt.ledger.starts(j)] == ["v2"], lt.explain(j)()


def test_replace_never_runs_a_second_copy_beside_a_started_one(lt: Lifetimes) -> None:
    j, task = job(), lt.task("replace")
    first = task.delay(j, "v1")
    lt.started(j)
    assert task.delay(j, "v2").id == first.id  # the started copy answers
    lt.ledger.release(j)
    assert lt.outcome(j, first.id)["value"] == "v1"
    lt.fleet.wait_idle(lt.broker)  # a second copy would be queued or running now
    assert [s["version"] for s in lt.ledger.starts(j)] == ["v1"]
    assert len(lt.ledger.outcomes(j)) == 1


# -- lock_until="start" meeting slots, rate turns and a running copy ---------------------


def _succeeded(lt: Lifetimes, job_id: str, task_id: str) -> None:
    """`task_id` (a published job's AsyncResult id) ends SUCCESS; else it was lost."""
    wait_for(
        lambda: any(o["state"] == "SUCCESS" for o in lt.ledger.outcomes(job_id, task_id)),
        DEADLINE * 2, 0.05,
        lambda: f"task {task_id} never succeeded (lost?)\n{lt.explain(job_id)()}",
    )  # fmt: skip


def _granted(lt: Lifetimes, task: Any, job_id: str) -> None:
    """Wait until `job_id`'s lease is held: granted, and waiting before its body."""
    key, _ = task.identity((job_id,), {})
    backend = runtime_for(lt.app).backend
    wait_for(lambda: backend.inspect(key) is not None, DEADLINE, 0.005, lt.explain(job_id))


def test_lock_until_start_a_job_waiting_for_its_slot_is_never_deduplicated_away(
    lt: Lifetimes,
) -> None:
    """concurrency=1: a job waits for the slot and is published again (requeue) while a
    newer copy of its key is published; every published job must still take effect."""
    a, b, task = job(), job(), lt.task("slot")
    first = task.delay(a, "v1")
    lt.started(a)  # holds the only slot until its gate opens
    waiting = task.delay(b, "v1")
    _granted(lt, task, b)  # its lease granted, its body not started: waiting for the slot
    newer = task.delay(b, "v2")

    def requeues() -> int:
        return sum(o["state"] == "IGNORED" for o in lt.ledger.outcomes(b))

    seen = requeues()
    # Published again at least once since the newer publish (a second cycle if one was in
    # flight), or the newer copy went out beside it and had its own first delivery.
    wait_for(lambda: requeues() >= seen + 2 or (newer.id != waiting.id and any(
        o["task_id"] == newer.id for o in lt.ledger.outcomes(b))), DEADLINE, 0.05,
        lt.explain(b))  # fmt: skip
    lt.ledger.release(a)
    lt.ledger.release(b)
    for job_id, result in ((a, first), (b, waiting), (b, newer)):
        _succeeded(lt, job_id, result.id)
    assert newer.id == waiting.id, "a publish while the job waited for its slot went beside it"
    assert [s["version"] for s in lt.ledger.starts(b)] == ["v1"], lt.explain(b)()


def test_lock_until_start_a_job_sleeping_for_its_rate_turn_answers_a_newer_publish(
    lt: Lifetimes,
) -> None:
    """global_rate_limit, on_rate_limited="wait": the job sleeps in the worker for its turn
    holding its lease; it has not started, so a newer publish is its duplicate."""
    x, y, task = job(), job(), lt.task("rate")
    first = task.delay(x, "v1")
    lt.started(x)  # took the turn now; the next is lifetime_app.RATE's interval away
    waiting = task.delay(y, "v1")
    _granted(lt, task, y)
    assert lt.ledger.start_count(y) == 0, "the second job did not wait for its turn"
    newer = task.delay(y, "v2")
    lt.ledger.release(x)
    lt.ledger.release(y)
    for job_id, result in ((x, first), (y, waiting), (y, newer)):
        _succeeded(lt, job_id, result.id)
    assert newer.id == waiting.id, "a publish while the job waited for its turn went beside it"
    assert [s["version"] for s in lt.ledger.starts(y)] == ["v1"], lt.explain(y)()


def test_lock_until_start_a_retry_is_never_deduplicated_against_a_newer_queued_run(
    lt: Lifetimes,
) -> None:
    """The body retries after a newer run of its key was published (the claim went when the
    body started); the retry is the same job again and must go out, not be answered with
    the newer run's AsyncResult."""
    j, task = job(), lt.task("start_retried")
    first = task.delay(j, "v1")
    lt.started(j)
    newer = task.apply_async((j, "v2"), countdown=3)  # queued, holding the key's claim
    assert newer.id != first.id
    lt.ledger.release(j)  # the first body ends and retries
    _succeeded(lt, j, first.id)
    _succeeded(lt, j, newer.id)
    assert sorted(s["version"] for s in lt.ledger.starts(j)) == ["v1", "v1", "v2", "v2"]
    assert lt.ledger.max_concurrent(j) == 1


#: The first run's length: far past the 1 s TTL, Celery's 3 retries and wait_timeout (2 s).
LONG_RUN = 7.0


@pytest.mark.parametrize("policy", ["retry", "wait"])
def test_lock_until_start_a_newer_run_waits_behind_a_long_run_then_runs(
    lt: Lifetimes, policy: str
) -> None:
    j, task = job(), lt.task(f"queue_{policy}")
    first = task.delay(j, "v1")
    lt.started(j)
    began = time.monotonic()
    second = task.delay(j, "v2")
    assert second.id != first.id
    time.sleep(max(0.0, LONG_RUN - (time.monotonic() - began)))  # the run's length, by design
    assert lt.ledger.start_count(j) == 1, "the newer run started beside the running one"
    lt.ledger.release(j)
    _succeeded(lt, j, first.id)
    _succeeded(lt, j, second.id)
    failed = [o for o in lt.ledger.outcomes(j, second.id) if o["state"] not in (
        "SUCCESS", "IGNORED")]  # fmt: skip
    assert not failed, f"the newer run failed or spent a retry while it waited: {failed}"
    starts, ends = lt.ledger.starts(j), lt.ledger.ends(j)
    assert [s["version"] for s in starts] == ["v1", "v2"], lt.explain(j)()
    assert lt.ledger.max_concurrent(j) == 1
    assert starts[1]["t"] >= ends[0]["t"], "the newer run ran beside the running one"


@ON_REDIS_ONLY
@pytest.mark.parametrize("policy", ["retry", "wait"])
def test_lock_until_finish_a_duplicate_waits_behind_a_long_run_then_gets_its_result(
    lt: Lifetimes, policy: str
) -> None:
    """A duplicate delivered during a run 7x its lease TTL spends no retry and does not give
    up while the run lives; once it ends, the duplicate answers with its DONE record."""
    j, task = job(), lt.task(f"behind_{policy}")
    first = task.delay(j, "v1")
    lt.started(j)
    began = time.monotonic()
    second = task.delay(j, "v1")
    time.sleep(max(0.0, LONG_RUN - (time.monotonic() - began)))  # the run's length, by design
    lt.ledger.release(j)
    _succeeded(lt, j, first.id)
    _succeeded(lt, j, second.id)
    failed = [o for o in lt.ledger.outcomes(j, second.id) if o["state"] not in (
        "SUCCESS", "IGNORED")]  # fmt: skip
    assert not failed, f"the duplicate failed or spent a retry while it waited: {failed}"
    answers = [o["value"] for o in lt.ledger.outcomes(j, second.id) if o["state"] == "SUCCESS"]
    assert answers == ["v1"], lt.explain(j)()  # the run's result, replayed
    assert lt.ledger.start_count(j) == 1, "the duplicate ran the job again"


@ON_REDIS_ONLY
def test_lock_until_start_a_run_queued_behind_a_holder_that_dies_gets_in(lt: Lifetimes) -> None:
    """The holder's pool process is killed mid-run: its lease is no longer renewed and
    expires (1 s TTL), and the run queued behind it gets in; nothing is lost."""
    j, task = job(), lt.task("queue_retry")
    first = task.delay(j, "v1")
    lt.started(j)
    holder = int(lt.ledger.starts(j)[0]["pid"])
    second = task.delay(j, "v2")
    # Queued behind the live holder: published again at least once.
    wait_for(lambda: any(o["state"] == "IGNORED" for o in lt.ledger.outcomes(j, second.id)),
             DEADLINE, 0.05, lt.explain(j))  # fmt: skip
    lt.fleet.kill_child(holder)
    lt.ledger.release(j)
    _succeeded(lt, j, second.id)
    _succeeded(lt, j, first.id)  # the killed run's message comes back (acks_late) and runs
    assert sorted(s["version"] for s in lt.ledger.starts(j)) == ["v1", "v1", "v2"]


# -- issue 34: the newest run supersedes the running one; a debounced burst ------------------


def test_the_newest_publish_supersedes_the_running_copy_on_a_fleet(lt: Lifetimes) -> None:
    """On each lock backend (its grant removed by fence): the running copy stops at its
    lease check and ends JobSuperseded without an effect; the newest runs, once."""
    j, task = job(), lt.task("supersede")
    first = task.delay(j, "v1")
    lt.started(j)
    second = task.delay(j, "v2")
    assert lt.outcome(j, first.id)["error"] == "JobSuperseded", lt.explain(j)()
    lt.started(j, 2)  # the newest run began, the old one gone
    lt.ledger.release(j)
    assert lt.outcome(j, second.id)["value"] == "v2"
    assert [e["version"] for e in lt.ledger.effects(j)] == ["v2"], lt.explain(j)()
    starts = lt.ledger.starts(j)
    assert [s["version"] for s in starts] == ["v1", "v2"], lt.explain(j)()


def test_a_debounced_burst_runs_once_with_the_last_arguments_on_a_fleet(lt: Lifetimes) -> None:
    j, task = job(), lt.task("debounce")
    burst = [task.delay(j, f"v{i}") for i in range(4)]  # within the quiet period
    assert lt.outcome(j, burst[-1].id)["value"] == "v3"
    for earlier in burst[:-1]:
        assert lt.outcome(j, earlier.id)["error"] == "JobSuperseded", lt.explain(j)()
    assert [e["version"] for e in lt.ledger.effects(j)] == ["v3"], lt.explain(j)()
