"""The lock-gated executor on Redis and in memory: replay, conflicts, policies, failures."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from jobfence.locks import (
    AcquireTimeout,
    BackendUnavailable,
    Backoff,
    Lease,
    LeaseKeeper,
    LockBackend,
    LockError,
    MemoryBackend,
    NotOwner,
    StaleFence,
)
from jobfence.locks.backend import default_meta
from jobfence.tasks import (
    DUPLICATE,
    SUPERSEDED,
    ArgumentsNotSerializable,
    DuplicateJob,
    Executor,
    IdempotencyConflict,
    JobContext,
    current_job,
    current_lease,
)
from jobfence.tasks.executor import DROPPED, Redelivery, RedeliveryLimitReached
from jobfence.tasks.metrics import Metrics
from tests.servers import wait_for
from tests.tasks.conftest import spec_for, unique


class Calls:
    """A body that counts its calls and returns `value` (or what `fn` returns)."""

    def __init__(self, value: Any = None, fn: Callable[[JobContext], Any] | None = None) -> None:
        self.value = value
        self.fn = fn
        self.count = 0
        self.contexts: list[JobContext] = []

    def __call__(self, ctx: JobContext) -> Any:
        self.count += 1
        self.contexts.append(ctx)
        return self.fn(ctx) if self.fn is not None else self.value


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def hold(
    backend: LockBackend, key: str, *, task_id: str = "holder", fp: str = "", ttl: float = 30
) -> Lease:
    """Another worker's grant of `key` (as the executor would take it)."""
    got = backend.begin(
        key,
        ttl,
        meta=default_meta(task_id=task_id, task_name="tests.job"),
        record=True,
        fingerprint=fp or "fp-" + key,
    )
    assert isinstance(got, Lease), got
    return got


# -- the happy path and replays ----------------------------------------------------------


def test_runs_the_body_and_stores_done(executor: Executor, backend: LockBackend) -> None:
    key = unique()
    body = Calls({"charged": 100})
    out = executor.run(spec_for(key), body)
    assert (out.status, out.value, body.count) == ("ran", {"charged": 100}, 1)
    record = backend.job_record(key)
    assert record is not None and record.state == "DONE"
    assert json.loads(record.result) == {"charged": 100}
    assert record.fingerprint == "fp-" + key and record.fence == out.fence
    assert backend.inspect(key) is None  # released by the commit
    assert executor.keeper.held() == []


def test_done_short_circuits_without_calling_the_body(
    executor: Executor, backend: LockBackend, metrics: Metrics
) -> None:
    key = unique()
    first = executor.run(spec_for(key), Calls([1, "two", {"3": None}]))
    again = Calls("must not run")
    out = executor.run(spec_for(key, task_id="redelivery"), again)
    assert out.status == "replayed"
    assert out.value == [1, "two", {"3": None}]
    assert out.fence == first.fence
    assert again.count == 0
    assert backend.inspect(key) is None  # a replay takes no lock
    assert sample(metrics, "jobfence_idempotent_replays_total", task="tests.job") == 1


def test_replay_of_a_none_result(executor: Executor) -> None:
    key = unique()
    executor.run(spec_for(key), Calls(None))
    out = executor.run(spec_for(key), Calls("nope"))
    assert (out.status, out.value) == ("replayed", None)


def test_same_key_other_arguments_conflicts_and_nothing_runs(
    executor: Executor, backend: LockBackend
) -> None:
    key = unique()
    executor.run(spec_for(key), Calls("original"))
    other = Calls("other")
    with pytest.raises(IdempotencyConflict, match="different arguments") as info:
        executor.run(spec_for(key, fingerprint="fp-other"), other)
    assert info.value.key == key
    assert other.count == 0
    record = backend.job_record(key)
    assert record is not None and json.loads(record.result) == "original"
    assert backend.inspect(key) is None


@pytest.mark.parametrize("policy", ["skip", "wait", "retry", "raise"])
def test_same_key_other_arguments_conflicts_while_the_job_runs(
    executor: Executor, backend: LockBackend, policy: str
) -> None:
    """The fingerprint travels with the lease: a conflict is told during the run too."""
    key = unique()
    holder = hold(backend, key, task_id="holder", fp="fp-original")
    other = Calls("other")
    with pytest.raises(IdempotencyConflict, match="running job with different arguments"):
        executor.run(
            spec_for(key, fingerprint="fp-other", on_conflict=policy, task_id="mine"), other
        )
    assert other.count == 0
    info = backend.inspect(key)
    assert info is not None and info.fence == holder.fence  # the holder is untouched
    # The same arguments are a plain duplicate, as before.
    same = executor.run(spec_for(key, fingerprint="fp-original", task_id="mine"), other)
    assert same.status == "duplicate" and other.count == 0


# -- busy: the conflict policies ---------------------------------------------------------


def test_busy_skip_returns_the_duplicate_marker(
    executor: Executor, backend: LockBackend, metrics: Metrics
) -> None:
    key = unique()
    holder = hold(backend, key)
    body = Calls("x")
    out = executor.run(spec_for(key, on_conflict="skip", task_id="mine"), body)
    assert (out.status, out.value, body.count) == ("duplicate", DUPLICATE, 0)
    assert sample(metrics, "jobfence_conflicts_total", task="tests.job", policy="skip") == 1
    info = backend.inspect(key)
    assert info is not None and info.fence == holder.fence  # the holder is untouched


def test_busy_raise_raises_duplicate_job(executor: Executor, backend: LockBackend) -> None:
    key = unique()
    hold(backend, key)
    body = Calls("x")
    with pytest.raises(DuplicateJob) as info:
        executor.run(spec_for(key, on_conflict="raise", task_id="mine"), body)
    assert info.value.key == key and body.count == 0


def test_busy_retry_asks_for_a_countdown(executor: Executor, backend: LockBackend) -> None:
    key = unique()
    hold(backend, key)
    body = Calls("x")
    out = executor.run(spec_for(key, on_conflict="retry", task_id="mine"), body)
    assert out.status == "retry" and body.count == 0
    # The holder's TTL left plus jitter (backoff cap 0.05 s).
    assert 0 < out.countdown <= 30 + 0.05


def test_busy_wait_blocks_until_the_holder_commits_then_replays(
    executor: Executor, backend: LockBackend, metrics: Metrics
) -> None:
    key = unique()
    started, go = threading.Event(), threading.Event()

    def slow(ctx: JobContext) -> dict[str, int]:
        started.set()
        assert go.wait(10)
        return {"fence": ctx.fence}

    waiter_body = Calls("must not run")
    with ThreadPoolExecutor(2) as pool:
        holder = pool.submit(executor.run, spec_for(key, task_id="holder"), slow)
        assert started.wait(10)
        waiter = pool.submit(
            executor.run,
            spec_for(key, task_id="waiter", on_conflict="wait", wait_timeout=20),
            waiter_body,
        )
        # The waiter has found the job busy at least once before the holder finishes.
        wait_for(
            lambda: sample(metrics, "jobfence_conflicts_total", task="tests.job", policy="wait"),
            10,
        )
        assert not waiter.done()
        go.set()
        held_out = holder.result(10)
        t0 = time.monotonic()
        out = waiter.result(10)
    assert held_out.status == "ran"
    assert out.status == "replayed"
    assert out.value == {"fence": held_out.fence}
    assert waiter_body.count == 0
    assert time.monotonic() - t0 < 5  # woken by the release, not by the 30 s TTL


def test_busy_wait_runs_the_job_itself_when_the_holder_fails(
    executor: Executor, metrics: Metrics
) -> None:
    key = unique()
    started, go = threading.Event(), threading.Event()

    def failing(ctx: JobContext) -> None:
        started.set()
        assert go.wait(10)
        raise RuntimeError("holder crashed")

    waiter_body = Calls("waiter did it")
    with ThreadPoolExecutor(2) as pool:
        holder = pool.submit(executor.run, spec_for(key, task_id="holder"), failing)
        assert started.wait(10)
        waiter = pool.submit(
            executor.run,
            spec_for(key, task_id="waiter", on_conflict="wait", wait_timeout=20),
            waiter_body,
        )
        wait_for(
            lambda: sample(metrics, "jobfence_conflicts_total", task="tests.job", policy="wait"),
            10,
        )
        go.set()
        with pytest.raises(RuntimeError):
            holder.result(10)
        out = waiter.result(10)
    assert (out.status, out.value, waiter_body.count) == ("ran", "waiter did it", 1)


def test_busy_wait_takes_over_when_the_holder_vanishes(
    executor: Executor, backend: LockBackend
) -> None:
    """A holder that died without releasing: the waiter notices the expiry and runs."""
    key = unique()
    dead = hold(backend, key, ttl=0.3)
    body = Calls("took over")
    t0 = time.monotonic()
    out = executor.run(spec_for(key, on_conflict="wait", wait_timeout=10, task_id="w"), body)
    assert (out.status, body.count) == ("ran", 1)
    assert out.fence is not None and out.fence > dead.fence
    assert time.monotonic() - t0 < 5


def test_busy_wait_times_out(executor: Executor, backend: LockBackend, metrics: Metrics) -> None:
    key = unique()
    hold(backend, key)
    body = Calls("x")
    t0 = time.monotonic()
    with pytest.raises(AcquireTimeout) as info:
        executor.run(spec_for(key, on_conflict="wait", wait_timeout=0.3, task_id="w"), body)
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 5
    assert info.value.key == key and body.count == 0
    assert sample(metrics, "jobfence_acquire_timeouts_total", task="tests.job") == 1


def test_busy_wait_zero_timeout_fails_at_once(executor: Executor, backend: LockBackend) -> None:
    key = unique()
    hold(backend, key)
    with pytest.raises(AcquireTimeout):
        executor.run(spec_for(key, on_conflict="wait", wait_timeout=0, task_id="w"), Calls())


@pytest.mark.parametrize("policy", ["skip", "wait", "retry", "raise"])
def test_busy_by_the_same_task_id_defers_whatever_the_policy(
    executor: Executor, backend: LockBackend, policy: str
) -> None:
    key = unique()
    hold(backend, key, task_id="task-1")
    body = Calls("x")
    out = executor.run(spec_for(key, task_id="task-1", on_conflict=policy), body)
    assert out.status == "defer" and body.count == 0
    assert 0 < out.countdown <= 30 + 0.05


# -- failures ------------------------------------------------------------------------------


def test_a_failed_record_keeps_the_message_only_when_asked(
    executor: Executor, backend: LockBackend
) -> None:
    def boom(ctx: JobContext) -> None:
        raise RuntimeError("card 4111111111111111 declined")

    for keep, expected in [
        (False, {"error": "RuntimeError"}),
        (True, {"error": "RuntimeError", "message": "card 4111111111111111 declined"}),
    ]:
        key = unique()
        with pytest.raises(RuntimeError, match="declined"):
            executor.run(spec_for(key, failed_message=keep), boom)
        record = backend.job_record(key)
        assert record is not None and record.state == "FAILED"
        assert json.loads(record.result) == expected


def test_body_exception_records_failed_and_allows_a_fresh_run(
    executor: Executor, backend: LockBackend
) -> None:
    key = unique()

    def boom(ctx: JobContext) -> None:
        raise RuntimeError("card declined")

    with pytest.raises(RuntimeError, match="card declined"):
        executor.run(spec_for(key), boom)
    record = backend.job_record(key)
    assert record is not None and record.state == "FAILED"
    assert json.loads(record.result) == {"error": "RuntimeError"}  # the message is not kept
    assert backend.inspect(key) is None
    first_fence = record.fence

    body = Calls("second time lucky")
    out = executor.run(spec_for(key), body)
    assert (out.status, body.count) == ("ran", 1)
    assert out.fence is not None and out.fence > first_fence
    record = backend.job_record(key)
    assert record is not None and record.state == "DONE"


def test_passthrough_exception_releases_without_a_record(
    executor: Executor, backend: LockBackend
) -> None:
    class RetryLater(Exception):
        pass

    key = unique()

    def retry(ctx: JobContext) -> None:
        raise RetryLater()

    with pytest.raises(RetryLater):
        executor.run(spec_for(key), retry, passthrough=(RetryLater,))
    assert backend.job_record(key) is None
    assert backend.inspect(key) is None
    assert executor.keeper.held() == []
    assert executor.run(spec_for(key), Calls("ok")).status == "ran"


def test_stale_fence_in_the_body_is_superseded(executor: Executor, backend: LockBackend) -> None:
    key = unique()

    def stale(ctx: JobContext) -> None:
        raise StaleFence(resource="account:1", fence=ctx.fence, last=ctx.fence + 1)

    out = executor.run(spec_for(key), stale)
    assert (out.status, out.value) == ("superseded", SUPERSEDED)
    assert backend.job_record(key) is None
    assert backend.inspect(key) is None  # ours, so released


def _other_client(request: pytest.FixtureRequest, backend: LockBackend) -> LockBackend:
    if backend.name in ("redis", "mysql"):
        fixture = "other_redis_backend" if backend.name == "redis" else "other_mariadb_backend"
        other: LockBackend = request.getfixturevalue(fixture)
        return other
    return backend


def test_lease_lost_in_the_body_is_superseded_and_spares_the_new_holder(
    executor: Executor, backend: LockBackend, request: pytest.FixtureRequest
) -> None:
    key = unique()
    other = _other_client(request, backend)
    thief: list[Lease] = []

    def stolen(ctx: JobContext) -> None:
        assert backend.force_release(key)
        thief.append(hold(other, key, task_id="thief"))
        ctx.lease.extend()  # owner-checked: NotOwner, a LeaseLost

    out = executor.run(spec_for(key, task_id="victim"), stolen)
    assert out.status == "superseded"
    assert backend.job_record(key) is None
    info = other.inspect(key)
    assert info is not None and info.fence == thief[0].fence  # our release did not touch it
    assert thief[0].fence > (out.fence or 0)


def test_commit_is_refused_when_the_lease_was_stolen_and_the_job_superseded(
    executor: Executor, backend: LockBackend, request: pytest.FixtureRequest
) -> None:
    key = unique()
    other = _other_client(request, backend)
    thief: list[Lease] = []

    def finishes_late(ctx: JobContext) -> str:
        assert backend.force_release(key)
        thief.append(hold(other, key, task_id="thief"))
        return "stale result"

    out = executor.run(spec_for(key, task_id="victim"), finishes_late)
    # The body finished, but the owner-checked commit stored nothing for the stale holder:
    # never reported done; the new holder is the proof it moved on (superseded).
    assert out.status == "superseded"
    assert backend.job_record(key) is None
    info = other.inspect(key)
    assert info is not None and info.fence == thief[0].fence
    # The new holder commits its own result, and that is what later deliveries replay.
    assert other.commit(
        thief[0], state="DONE", result='"fresh"', fingerprint="fp-" + key, result_ttl=60
    )
    replay = executor.run(spec_for(key), Calls("nope"))
    assert (replay.status, replay.value, replay.fence) == ("replayed", "fresh", thief[0].fence)


def test_lease_lost_without_a_newer_holder_is_redelivered_not_superseded(
    executor: Executor, backend: LockBackend
) -> None:
    """No DONE record and no other owner: nothing proves the job moved on, so it comes back."""
    key = unique()

    def lose(ctx: JobContext) -> None:
        ctx.lease.mark_lost(NotOwner("test", key=key))
        ctx.check()

    out = executor.run(spec_for(key), lose)
    assert out.status == "redeliver" and out.countdown > 0
    assert "without proof" in out.reason
    assert executor.keeper.held() == []
    assert backend.inspect(key) is None  # still ours on the server: released for the next run
    assert backend.job_record(key) is None


def test_lease_lost_after_another_worker_finished_is_superseded(
    executor: Executor, backend: LockBackend, request: pytest.FixtureRequest
) -> None:
    """A DONE record is proof the job moved on: no redelivery."""
    key = unique()
    other = _other_client(request, backend)

    def overtaken(ctx: JobContext) -> None:
        assert backend.force_release(key)
        newer = hold(other, key, task_id="newer")
        assert other.commit(newer, state="DONE", result='"theirs"', fingerprint="fp-" + key,
                            result_ttl=60)
        ctx.lease.extend()  # NotOwner

    out = executor.run(spec_for(key, task_id="older"), overtaken)
    assert (out.status, out.value) == ("superseded", SUPERSEDED)
    record = backend.job_record(key)
    assert record is not None and json.loads(record.result) == "theirs"


def test_on_lease_lost_drop_gives_at_most_once(executor: Executor, backend: LockBackend) -> None:
    key = unique()

    def lose(ctx: JobContext) -> None:
        ctx.lease.mark_lost(NotOwner("test", key=key))
        ctx.check()

    out = executor.run(spec_for(key, on_lease_lost="drop"), lose)
    assert (out.status, out.value) == ("dropped", DROPPED)
    assert backend.job_record(key) is None and backend.inspect(key) is None


def test_redeliveries_back_off_with_jitter(backend: LockBackend, keeper: LeaseKeeper) -> None:
    executor = Executor(
        backend, keeper, backoff=Backoff(0.005, 0.05), redelivery=Redelivery(limit=9, base=0.5)
    )
    key = unique()

    def lose(ctx: JobContext) -> None:
        ctx.lease.mark_lost(NotOwner("test", key=key))
        ctx.check()

    delays = [executor.run(spec_for(key, redeliveries=n), lose).countdown for n in range(8)]
    for n, delay in enumerate(delays):
        step = min(60.0, 0.5 * 2**n)
        assert step / 2 <= delay <= step, (n, delay)


def test_past_the_redelivery_limit_the_job_fails_on_record(
    backend: LockBackend, keeper: LeaseKeeper, caplog: pytest.LogCaptureFixture
) -> None:
    executor = Executor(
        backend, keeper, backoff=Backoff(0.005, 0.05), redelivery=Redelivery(limit=3)
    )
    key = unique()

    def lose(ctx: JobContext) -> None:
        ctx.lease.mark_lost(NotOwner("test", key=key))
        ctx.check()

    assert executor.run(spec_for(key, redeliveries=2), lose).status == "redeliver"
    with pytest.raises(RedeliveryLimitReached, match="JOBFENCE_REDELIVERY_LIMIT"):
        executor.run(spec_for(key, redeliveries=3), lose)
    record = backend.job_record(key)
    assert record is not None and record.state == "FAILED"
    assert json.loads(record.result)["error"] == "RedeliveryLimitReached"
    assert any(r.levelname == "ERROR" and "given up" in r.getMessage() for r in caplog.records)
    assert backend.inspect(key) is None
    # A fresh submission may run it again (FAILED does not stop a new run).
    assert executor.run(spec_for(key), Calls("ok")).status == "ran"


class UnreachableBackend(MemoryBackend):
    """The lock server does not answer: every begin times out."""

    def _begin(self, *args: Any) -> Any:
        raise BackendUnavailable("timed out (test)")


def test_lock_server_unavailable_before_the_body_redelivers(
    keeper: LeaseKeeper, metrics: Metrics
) -> None:
    executor = Executor(UnreachableBackend(), keeper, backoff=Backoff(0.005, 0.05))
    body = Calls("x")
    out = executor.run(spec_for(unique()), body)
    assert out.status == "redeliver" and out.countdown > 0 and body.count == 0
    assert "unavailable" in out.reason


# -- the body's view -----------------------------------------------------------------------


def test_current_job_and_lease_inside_the_body(executor: Executor) -> None:
    key = unique()
    seen: dict[str, Any] = {}

    def body(ctx: JobContext) -> int:
        job = current_job()
        seen.update(
            same_job=job is ctx,
            same_lease=current_lease() is ctx.lease,
            key=job.key,
            fp=job.fingerprint,
            task_id=job.task_id,
            held=ctx.lease.held,
            kept=ctx.lease in executor.keeper.held(),
        )
        return ctx.fence

    out = executor.run(spec_for(key, task_id="t-1"), body)
    assert seen == {
        "same_job": True,
        "same_lease": True,
        "key": key,
        "fp": "fp-" + key,
        "task_id": "t-1",
        "held": True,
        "kept": True,
    }
    assert out.value == out.fence
    with pytest.raises(LockError, match="no jobfence job is running"):
        current_job()
    with pytest.raises(LockError):
        current_lease()


def test_nested_jobs_restore_the_outer_job(executor: Executor) -> None:
    outer_key, inner_key = unique(), unique()
    seen: list[str] = []

    def inner(ctx: JobContext) -> str:
        seen.append(current_job().key)
        return "inner"

    def outer(ctx: JobContext) -> str:
        seen.append(current_job().key)
        assert executor.run(spec_for(inner_key), inner).value == "inner"
        seen.append(current_job().key)
        return "outer"

    assert executor.run(spec_for(outer_key), outer).value == "outer"
    assert seen == [outer_key, inner_key, outer_key]


def test_current_job_is_per_thread(executor: Executor) -> None:
    seen: list[str] = []
    barrier = threading.Barrier(2, timeout=10)

    def body(ctx: JobContext) -> None:
        barrier.wait()  # both bodies run at once, each sees its own job
        seen.append(current_job().key + "=" + ctx.key)

    keys = [unique(), unique()]
    with ThreadPoolExecutor(2) as pool:
        for fut in [pool.submit(executor.run, spec_for(k), body) for k in keys]:
            fut.result(10)
    assert sorted(seen) == sorted(f"{k}={k}" for k in keys)


def test_non_json_result_fails_the_job_and_releases_the_lease(
    executor: Executor, backend: LockBackend
) -> None:
    """A result that cannot be stored used to leave the lock held (and kept) until its TTL."""
    key = unique()
    with pytest.raises(ArgumentsNotSerializable, match=r"result of tests\.job"):
        executor.run(spec_for(key), Calls({"when": object()}))
    assert backend.inspect(key) is None
    assert executor.keeper.held() == []
    record = backend.job_record(key)
    assert record is not None and record.state == "FAILED"
    assert json.loads(record.result)["error"] == "ArgumentsNotSerializable"
    assert executor.run(spec_for(key), Calls("fixed")).status == "ran"


def test_nan_result_is_refused_the_same_way(executor: Executor, backend: LockBackend) -> None:
    key = unique()
    with pytest.raises(ArgumentsNotSerializable):
        executor.run(spec_for(key), Calls(float("nan")))
    assert backend.inspect(key) is None


def test_the_keeper_keeps_a_long_body_alive(backend: LockBackend, metrics: Metrics) -> None:
    keeper = LeaseKeeper()
    executor = Executor(backend, keeper, backoff=Backoff(0.005, 0.05), metrics=metrics)
    key = unique()
    ttl = 1.0  # 0.3 s left a MariaDB heartbeat no slack on a busy machine

    def long(ctx: JobContext) -> int:
        first_deadline = ctx.lease.deadline
        # Outlive the TTL several times over; the keeper must extend meanwhile.
        wait_for(lambda: ctx.lease.deadline > first_deadline + 2 * ttl, 10)
        ctx.check()
        return ctx.fence

    try:
        out = executor.run(spec_for(key, ttl=ttl), long)
    finally:
        keeper.stop()
    assert out.status == "ran"
    record = backend.job_record(key)
    assert record is not None and record.state == "DONE"  # the commit was still ours


def test_fences_increase_across_runs_of_one_key(executor: Executor, backend: LockBackend) -> None:
    key = unique()
    fences: list[int] = []
    for _ in range(3):
        out = executor.run(spec_for(key), Calls("v"))
        assert out.fence is not None
        fences.append(out.fence)
        assert backend.forget(key)
    assert fences == sorted(fences) and len(set(fences)) == 3
