"""Lock lifetimes (lock_until, unique_for) and duplicate publishes (on_duplicate_publish)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from jobfence.locks import (
    AcquireTimeout,
    BackendUnavailable,
    Backoff,
    Lease,
    LeaseKeeper,
    MemoryBackend,
)
from jobfence.locks.backend import default_meta
from jobfence.locks.semaphore import acquire_slot
from jobfence.tasks import (
    DUPLICATE,
    SUPERSEDED,
    DuplicatePublish,
    Executor,
    JobContext,
    JobSuperseded,
    TaskDefinitionError,
    runtime_for,
)
from jobfence.tasks.executor import STARTED, RateSpec
from jobfence.tasks.flow.marks import REPUBLISHED_HEADER as REPUBLISHED
from tests.tasks.conftest import AppFactory, spec_for, unique
from tests.tasks.test_singleton_task import define


@pytest.fixture
def memory() -> MemoryBackend:
    return MemoryBackend()


@pytest.fixture
def run_on(memory: MemoryBackend) -> Iterator[Executor]:
    keeper = LeaseKeeper()
    yield Executor(memory, keeper, backoff=Backoff(0.005, 0.05))
    keeper.stop()


class Body:
    """Counts calls; `during` runs inside the body (to look at the claim mid-run)."""

    def __init__(self, during: Any = None) -> None:
        self.calls = 0
        self.during = during
        self.seen: Any = None

    def __call__(self, ctx: JobContext) -> int:
        self.calls += 1
        if self.during is not None:
            self.seen = self.during()
        return self.calls


# -- the executor: records per run, the claim at start and finish ------------------------


def test_a_later_publish_runs_again_when_each_publish_is_its_own_run(run_on: Executor) -> None:
    key, body = unique(), Body()
    assert run_on.run(spec_for(key, task_id="A", lock_until="start"), body).status == "ran"
    again = run_on.run(spec_for(key, task_id="A", lock_until="start"), body)
    assert (again.status, again.value) == ("replayed", 1)  # its own redelivery replays
    assert run_on.run(spec_for(key, task_id="B", lock_until="start"), body).status == "ran"
    assert body.calls == 2


def test_control_by_default_a_later_publish_replays_the_first_result(run_on: Executor) -> None:
    key, body = unique(), Body()
    assert run_on.run(spec_for(key, task_id="A"), body).status == "ran"
    assert run_on.run(spec_for(key, task_id="B"), body).status == "replayed"
    assert body.calls == 1


def test_lock_until_start_frees_the_publish_claim_when_the_run_starts(
    run_on: Executor, memory: MemoryBackend
) -> None:
    key = unique()
    assert memory.claim_publish(key, "A", 60) is None
    body = Body(during=lambda: memory.claim_publish(key, "B", 60))
    spec = spec_for(key, task_id="A", lock_until="start", publish_claim=True)
    assert run_on.run(spec, body).status == "ran"
    assert body.seen is None, "a newer copy could not be published while the run ran"
    assert memory.claim_publish(key, "C", 60) == "B"  # the newer copy holds it now


def test_control_lock_until_finish_keeps_the_claim_while_the_run_runs(
    run_on: Executor, memory: MemoryBackend
) -> None:
    key = unique()
    assert memory.claim_publish(key, "A", 60) is None
    body = Body(during=lambda: memory.claim_publish(key, "B", 60))
    assert run_on.run(spec_for(key, task_id="A", publish_claim=True), body).status == "ran"
    assert body.seen == "A"


def test_a_replaced_copy_skips_as_superseded_without_running(
    run_on: Executor, memory: MemoryBackend
) -> None:
    key, body = unique(), Body()
    assert memory.claim_publish(key, "A", 60) is None
    assert memory.swap_publish(key, "A", "B", 60) is None  # B replaced A before it started
    out = run_on.run(spec_for(key, task_id="A", supersede=True, publish_claim=True), body)
    assert (out.status, out.value, body.calls) == ("superseded", SUPERSEDED, 0)
    assert memory.inspect(key) is None, "the superseded copy kept the lock"
    assert run_on.run(spec_for(key, task_id="B", supersede=True, publish_claim=True), body).status \
        == "ran"  # fmt: skip


def test_a_replaced_copy_skips_even_after_its_replacement_finished_with_other_arguments(
    run_on: Executor, memory: MemoryBackend
) -> None:
    key, body = unique(), Body()
    assert memory.claim_publish(key, "A", 60) is None
    assert memory.swap_publish(key, "A", "B", 60) is None
    replacement = spec_for(key, task_id="B", fingerprint="v2", supersede=True, publish_claim=True)
    assert run_on.run(replacement, body).status == "ran"
    old = spec_for(key, task_id="A", fingerprint="v1", supersede=True, publish_claim=True)
    out = run_on.run(old, body)  # not an IdempotencyConflict with B's record
    assert (out.status, body.calls) == ("superseded", 1)


def test_a_started_copy_cannot_be_replaced(run_on: Executor, memory: MemoryBackend) -> None:
    key = unique()
    assert memory.claim_publish(key, "A", 60) is None
    body = Body(during=lambda: memory.swap_publish(key, "A", "B", 60))
    spec = spec_for(key, task_id="A", supersede=True, publish_claim=True)
    assert run_on.run(spec, body).status == "ran"
    assert body.seen == STARTED + "A", "the claim was handed over while the copy ran"


def test_unique_for_throttles_runs_within_the_window_and_allows_after(
    run_on: Executor, memory: MemoryBackend
) -> None:
    key, body, window = unique(), Body(), 0.3
    assert run_on.run(spec_for(key, task_id="A", unique_for=window), body).status == "ran"
    finished = time.monotonic()
    out = run_on.run(spec_for(key, task_id="B", unique_for=window), body)
    assert (out.status, out.value, body.calls) == ("duplicate", DUPLICATE, 1)
    assert memory.inspect(key) is None, "the throttled run kept the lock"
    deadline = time.monotonic() + 5
    while run_on.run(spec_for(key, task_id="C", unique_for=window), body).status != "ran":
        assert time.monotonic() < deadline, "never ran again after the window"
    assert time.monotonic() - finished >= window * 0.9
    assert body.calls == 2


def test_each_run_may_bring_other_arguments_when_each_publish_is_its_own_run(
    run_on: Executor,
) -> None:
    key, body = unique(), Body()
    first = spec_for(key, task_id="A", lock_until="start", fingerprint="args-1")
    second = spec_for(key, task_id="B", lock_until="start", fingerprint="args-2")
    assert run_on.run(first, body).status == "ran"
    assert run_on.run(second, body).status == "ran"  # not an IdempotencyConflict


def test_lock_until_start_keeps_the_claim_while_the_job_waits_for_its_slot(
    run_on: Executor, memory: MemoryBackend
) -> None:
    """A publish while the job waits for its slot is a duplicate of it: not started yet."""
    key, group = unique(), unique("group")
    other = acquire_slot(memory, group, limit=1, ttl=30, timeout=0)  # the only slot, taken
    assert memory.claim_publish(key, "A", 60) is None
    spec = spec_for(key, task_id="A", lock_until="start", publish_claim=True, concurrency=1,
                    concurrency_key=group, on_conflict="wait", wait_timeout=0.05)  # fmt: skip
    assert run_on.run(spec, Body()).status == "requeue"
    assert memory.claim_publish(key, "B", 60) == "A", "the claim left before the body started"
    other.release()
    body = Body(during=lambda: memory.claim_publish(key, "C", 60))
    assert run_on.run(spec, body).status == "ran"
    assert body.seen is None, "the claim stayed after the body started"


def test_lock_until_start_keeps_the_claim_while_the_job_sleeps_for_its_rate_turn(
    run_on: Executor, memory: MemoryBackend
) -> None:
    key, limiter = unique(), unique("rate")
    assert memory.claim_publish(key, "A", 60) is None
    assert memory.take_rate(limiter, 0.4, 1, 0.0).admitted  # the turn now is another job's
    body = Body(during=lambda: memory.claim_publish(key, "B", 60))
    rate = RateSpec(key=limiter, label="tests.job", interval=0.4, on_limited="wait",
                    wait_timeout=5.0)  # fmt: skip
    spec = spec_for(key, task_id="A", lock_until="start", publish_claim=True, rate=rate,
                    on_conflict="wait")  # fmt: skip
    waiting = threading.Thread(target=run_on.run, args=(spec, body))
    waiting.start()
    # Granted and asleep for its turn: a newer publish is its duplicate.
    while memory.inspect(key) is None:
        time.sleep(0.005)
    newer = memory.claim_publish(key, "N", 60)
    waiting.join(10)
    assert (newer, body.calls, body.seen) == ("A", 1, None)


@pytest.mark.parametrize("policy", ["retry", "wait"])
def test_lock_until_start_queues_behind_another_run_without_spending_a_retry(
    run_on: Executor, memory: MemoryBackend, policy: str
) -> None:
    key = unique()
    holder = memory.begin(key, 30, meta=default_meta(task_id="A"), record=True)
    assert isinstance(holder, Lease)
    spec = spec_for(key, task_id="B", lock_until="start", on_conflict=policy, wait_timeout=0.05)
    out = run_on.run(spec, Body())  # retry: no Celery retry spent; wait: no AcquireTimeout
    assert out.status == "requeue", out
    assert 0 < out.countdown <= 30 + 0.05 + 1


@pytest.mark.parametrize("policy", ["retry", "wait"])
def test_lock_until_start_a_holder_that_dies_lets_the_queued_run_in(
    run_on: Executor, memory: MemoryBackend, policy: str
) -> None:
    """Nobody renews a dead holder's lease: it expires, and the run queued behind it runs."""
    key, body = unique(), Body()
    holder = memory.begin(key, 0.3, meta=default_meta(task_id="A"), record=True)
    assert isinstance(holder, Lease)  # never kept: its process is gone
    spec = spec_for(key, task_id="B", lock_until="start", on_conflict=policy, wait_timeout=0.01)
    deadline = time.monotonic() + 10
    while (out := run_on.run(spec, body)).status == "requeue":
        assert time.monotonic() < deadline, "the queued run never got in after the holder died"
        time.sleep(min(out.countdown, 0.05))
    assert (out.status, body.calls) == ("ran", 1)


@pytest.mark.parametrize("policy", ["retry", "wait"])
def test_lock_until_finish_a_brokered_duplicate_queues_behind_the_live_copy(
    run_on: Executor, memory: MemoryBackend, policy: str
) -> None:
    """Delivered through a broker, a duplicate of a running job queues behind it (no Celery
    retry spent, no AcquireTimeout), then replays its DONE record once it has one."""
    key, body = unique(), Body()
    holder = memory.begin(key, 30, meta=default_meta(task_id="A"), record=True,
                          fingerprint="fp-" + key)  # fmt: skip
    assert isinstance(holder, Lease)
    spec = spec_for(key, task_id="B", on_conflict=policy, wait_timeout=0.05, queues=True)
    out = run_on.run(spec, body)
    assert out.status == "requeue", out
    assert 0 < out.countdown <= 30 + 0.05 + 1
    assert memory.commit(holder, state="DONE", result='"v1"', fingerprint="fp-" + key,
                         result_ttl=60)  # fmt: skip
    out = run_on.run(spec, body)
    assert (out.status, out.value, body.calls) == ("replayed", "v1", 0)


def test_control_lock_until_finish_still_times_out_behind_a_copy_of_the_same_job(
    run_on: Executor, memory: MemoryBackend
) -> None:
    """Called directly or eagerly (no broker to queue through), a copy of the same job
    keeps wait's timeout and Celery's retries."""
    key = unique()
    assert isinstance(memory.begin(key, 30, meta=default_meta(task_id="A"), record=True), Lease)
    with pytest.raises(AcquireTimeout):
        run_on.run(spec_for(key, task_id="B", on_conflict="wait", wait_timeout=0.05), Body())
    out = run_on.run(spec_for(key, task_id="B", on_conflict="retry"), Body())
    assert out.status == "retry"


class ClaimsDown(MemoryBackend):
    """Locks work; the publish claims' compare-and-set finds the server unavailable."""

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        raise BackendUnavailable("claims down", key=key)


def test_a_claim_that_cannot_be_checked_at_start_delivers_the_job_again() -> None:
    backend, keeper, body = ClaimsDown(), LeaseKeeper(), Body()
    try:
        run_on = Executor(backend, keeper, backoff=Backoff(0.005, 0.05))
        key = unique()
        out = run_on.run(spec_for(key, task_id="A", supersede=True, publish_claim=True), body)
        assert (out.status, body.calls) == ("redeliver", 0)  # never run on a guess
        assert backend.inspect(key) is None, "the lease was kept"
    finally:
        keeper.stop()


# -- the decorator -----------------------------------------------------------------------


def _f(x: int, y: int = 0) -> int:
    return x + y


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"lock_until": "never"}, "lock_until"),
        ({"lock_until": "start"}, "on_conflict='skip'"),  # would drop the queued copy
        ({"unique_for": 0}, "unique_for"),
        ({"unique_for": -1}, "unique_for"),
        ({"unique_for": "60"}, "unique_for"),
        ({"unique_for": True}, "unique_for"),
        ({"unique_for": 5, "lock_until": "start", "on_conflict": "wait"}, "unique_for"),
        ({"on_duplicate_publish": "drop", "dedupe_on_publish": True}, "on_duplicate_publish"),
        ({"on_duplicate_publish": "raise"}, "dedupe_on_publish=True"),
        ({"on_duplicate_publish": "replace"}, "dedupe_on_publish=True"),
    ],
)
def test_decorator_refuses_bad_lifetimes_and_publish_policies(
    make_app: AppFactory, options: dict[str, Any], field: str
) -> None:
    app = make_app()
    with pytest.raises(TaskDefinitionError, match=field.replace("(", r"\(")):
        define(app, _f, **options)


# -- duplicate publishes (a real broker on the private Redis, no worker) -----------------


def test_raise_names_the_holders_task_id_and_never_the_arguments(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_app(eager=False)
    task = define(app, _f, dedupe_on_publish=True, on_duplicate_publish="raise")
    first = task.delay(424242)
    with pytest.raises(DuplicatePublish) as caught:
        task.delay(424242)
    assert caught.value.task_id == first.id
    assert first.id in str(caught.value) and "424242" not in str(caught.value)
    assert redis_client.llen("celery") == 1


def test_replace_supersedes_a_queued_copy_which_then_skips(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_app(eager=False)
    task = define(
        app, _f, key=["x"], dedupe_on_publish=True, on_duplicate_publish="replace"
    )
    old = task.delay(1, 1)
    new = task.delay(1, 2)
    assert new.id != old.id
    assert redis_client.llen("celery") == 2
    assert task.delay(1, 3).id not in (old.id, new.id)  # an unstarted copy is replaced again
    newest = runtime_for(app).backend.claim_publish(task.identity((1,), {})[0], "probe", 60)
    assert newest not in (old.id, new.id)
    # Delivered anyway (a revoke would have been lost): the old copies skip, the newest runs.
    for args, task_id in (((1, 1), old.id), ((1, 2), new.id)):
        with pytest.raises(JobSuperseded) as caught:
            task.apply(args, task_id=task_id)
        assert caught.value.marker == SUPERSEDED
    assert task.apply((1, 3), task_id=newest).get() == 4


def test_replace_returns_the_started_copy_instead_of_publishing_a_second(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_app(eager=False)
    task = define(app, _f, dedupe_on_publish=True, on_duplicate_publish="replace")
    first = task.delay(7)
    key, _ = task.identity((7,), {})
    backend = runtime_for(app).backend
    assert backend.swap_publish(key, first.id, STARTED + first.id, 60) is None  # it started
    assert task.delay(7).id == first.id
    assert redis_client.llen("celery") == 1


@pytest.mark.parametrize(
    "options",
    [{"unique_for": 60}, {"on_duplicate_publish": "replace"}, {"on_duplicate_publish": "raise"}],
)
def test_a_started_job_may_publish_its_own_retry(
    make_app: AppFactory, redis_client: redis.Redis, options: dict[str, Any]
) -> None:
    """A retry (or deferred copy) goes out under the same task id as the started job."""
    app = make_app(eager=False)
    task = define(app, _f, dedupe_on_publish=True, **options)
    first = task.delay(5)
    key, _ = task.identity((5,), {})
    assert runtime_for(app).backend.swap_publish(key, first.id, STARTED + first.id, 60) is None
    assert task.apply_async((5,), task_id=first.id).id == first.id
    assert redis_client.llen("celery") == 2, "the retry was taken for a duplicate"


def test_a_delivered_message_published_again_goes_out_whoever_holds_the_claim(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    """A requeue, rate turn, deferred copy, redelivery or retry is the same job again (same
    task id, marked by _copy_headers): never answered with a newer copy's AsyncResult."""
    app = make_app(eager=False)
    task = define(app, _f, dedupe_on_publish=True, lock_until="start", on_conflict="wait")
    first = task.delay(5)
    key, _ = task.identity((5,), {})
    assert runtime_for(app).backend.swap_publish(key, first.id, None, 60) is None  # started
    newer = task.delay(5)
    assert newer.id != first.id  # a newer run, queued behind the started one
    again = task.apply_async((5,), task_id=first.id, headers={REPUBLISHED: 1})
    assert again.id == first.id
    assert redis_client.llen("celery") == 3, "the re-published copy was taken for a duplicate"
    assert REPUBLISHED.encode() not in b"".join(redis_client.lrange("celery", 0, -1))


def test_a_throttled_job_that_failed_frees_its_key_for_a_fresh_submission(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_app(eager=False)

    def boom(x: int) -> int:
        raise RuntimeError("failed for good")

    task = define(app, boom, dedupe_on_publish=True, unique_for=60)
    first = task.delay(3)
    with pytest.raises(RuntimeError):
        task.apply((3,), task_id=first.id, throw=True)
    assert task.delay(3).id != first.id, "a failed job kept its key throttled"
