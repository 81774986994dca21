"""concurrency= on the executor and @singleton_task: slot after job lease, requeue, refusals."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from jobfence.locks import Backoff, LeaseKeeper, LeaseLost, MemoryBackend, NotOwner
from jobfence.locks.backends.etcd import EtcdBackend
from jobfence.tasks import Executor, JobContext, singleton_task
from jobfence.tasks.errors import TaskDefinitionError
from jobfence.tasks.metrics import Metrics
from jobfence.worker.checks import check_semaphores
from tests.tasks.conftest import spec_for, unique


@pytest.fixture
def executor() -> Executor:
    return Executor(MemoryBackend(), LeaseKeeper(), backoff=Backoff(0.001, 0.01), metrics=Metrics())


def test_a_job_without_a_free_slot_is_requeued_and_its_job_lock_freed(executor: Executor) -> None:
    group = unique("group")
    inside, leave = threading.Event(), threading.Event()

    def hold(_ctx: JobContext) -> str:
        inside.set()
        leave.wait(10)
        return "first"

    first = spec_for(unique(), concurrency=1, concurrency_key=group)
    runner = threading.Thread(target=executor.run, args=(first, hold))
    runner.start()
    assert inside.wait(10)
    second = spec_for(unique(), concurrency=1, concurrency_key=group, wait_timeout=0.05)
    out = executor.run(second, lambda _ctx: "second")
    assert out.status == "requeue" and out.countdown >= 1.0
    assert executor.backend.inspect(second.key) is None  # no job lock left behind
    leave.set()
    runner.join(10)
    assert executor.run(second, lambda _ctx: "second").value == "second"
    assert executor.backend.semaphore_holders(group) == []  # every slot given back
    samples = executor.metrics.registry.get_sample_value
    assert samples("jobfence_semaphore_requeues_total", {"semaphore": "tests.job"}) == 1
    assert samples("jobfence_semaphore_slots_held", {"semaphore": "tests.job"}) == 0
    assert samples("jobfence_semaphore_limit", {"semaphore": "tests.job"}) == 1
    assert samples("jobfence_semaphore_wait_seconds_count", {"semaphore": "tests.job"}) == 2


def test_a_duplicate_delivery_never_takes_a_slot(executor: Executor) -> None:
    group, key = unique("group"), unique()
    inside, leave = threading.Event(), threading.Event()

    def hold(_ctx: JobContext) -> None:
        inside.set()
        leave.wait(10)

    runner = threading.Thread(
        target=executor.run, args=(spec_for(key, concurrency=2, concurrency_key=group), hold)
    )
    runner.start()
    assert inside.wait(10)
    out = executor.run(spec_for(key, concurrency=2, concurrency_key=group), lambda _: None)
    assert out.status == "duplicate"
    assert len(executor.backend.semaphore_holders(group)) == 1
    leave.set()
    runner.join(10)


def test_a_lost_slot_stops_the_job_like_a_lost_lease(executor: Executor) -> None:
    group = unique("group")

    def body(ctx: JobContext) -> None:
        (slot,) = [s for s in executor.keeper.held() if s.key == group]
        executor.backend.semaphore_leave(group, slot.owner)  # taken away behind its back
        with pytest.raises(NotOwner):
            slot.extend()
        ctx.check()

    out = executor.run(spec_for(unique(), concurrency=1, concurrency_key=group), body)
    assert out.status == "redeliver"  # LeaseLost with no proof of a newer holder


def test_job_context_check_raises_once_the_slot_is_lost(executor: Executor) -> None:
    group, seen = unique("group"), []

    def body(ctx: JobContext) -> None:
        (slot,) = [s for s in executor.keeper.held() if s.key == group]
        slot.mark_lost(RuntimeError("gone"))
        try:
            ctx.check()
        except LeaseLost as exc:
            seen.append(exc)
            raise

    executor.run(spec_for(unique(), concurrency=1, concurrency_key=group), body)
    assert seen and "concurrency slot lost" in str(seen[0])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"concurrency": -1}, "concurrency must be a positive integer"),
        ({"concurrency": True}, "concurrency must be a positive integer"),
        ({"concurrency_key": ["account"]}, "add concurrency=N"),
        ({"concurrency": 2, "concurrency_key": ["acount"]}, "did you mean 'account'"),
        ({"concurrency": 2, "concurrency_key": []}, "concurrency_key=\\[\\] names no argument"),
    ],
)
def test_bad_concurrency_options_are_refused_at_decoration(
    options: dict[str, Any], message: str
) -> None:
    app = Celery(unique("app"), set_as_current=False)

    def job(account: str, job_id: str) -> None: ...

    with pytest.raises(TaskDefinitionError, match=message):
        singleton_task(app=app, name=unique("task"), **options)(job)


def test_start_up_refuses_concurrency_on_a_backend_without_semaphores() -> None:
    app = Celery(unique("app"), set_as_current=False)

    def job(account: str) -> None: ...

    task = singleton_task(app=app, name="t.limited", concurrency=2, concurrency_key="account")(job)
    etcd = SimpleNamespace(backend=object.__new__(EtcdBackend))
    (finding,) = check_semaphores(etcd, [task])  # type: ignore[arg-type]
    assert finding.refuse
    assert "etcd" in str(finding) and "t.limited" in str(finding) and "redis" in str(finding)
    memory = SimpleNamespace(backend=MemoryBackend())
    assert list(check_semaphores(memory, [task])) == []  # type: ignore[arg-type]


def test_the_body_sees_its_slot_and_its_fence(executor: Executor) -> None:
    group, seen = unique("group"), []
    out = executor.run(
        spec_for(unique(), concurrency=3, concurrency_key=group),
        lambda ctx: seen.append((ctx.slot, ctx.fence)),
    )
    assert out.status == "ran"
    ((slot, job_fence),) = seen
    assert slot is not None and slot.key == group and slot.fence > 0 and job_fence > 0
    assert slot.released
