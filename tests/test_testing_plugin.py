"""The `jobfence` pytest fixture in a user's own project: the user's suite (a naive Celery task,
an unsafe `@singleton_task` whose write is neither fenced nor idempotent, and a safe one whose
effect commits with its DONE row through `SqlEffects`, run with pytester in a subprocess) run
twice against a private Redis configured as its lock server. Each fault helper reaches the
path it names: its test fails the naive task, fails the unsafe task where the fault can make
the lock alone run a write twice (a lost lease, a stale fence, a commit whose outcome is
unknown), and passes the safe task; tests and runs do not leak into each other; nothing
reaches Redis."""

from __future__ import annotations

import re
from importlib.metadata import entry_points

import pytest

from devstack.redis_server import RedisServer

pytest_plugins = ["pytester"]

APP = '''
from celery import Celery

import jobfence

app = Celery("userproj", broker="memory://", backend="cache+memory://")
jobfence.setup(app)  # JOBFENCE_LOCK_URL: the developer's own (real) Redis
'''

TASKS = '''
from sqlalchemy import create_engine

from jobfence import current_job, singleton_task
from jobfence.locks.guards import SqlFenceGuard
from jobfence.tasks.effects import SqlEffects
from userproj.app import app

LEDGER: list[int] = []  # the charges, in order
GUARD = SqlFenceGuard()
STORE = {}


def reset() -> None:
    LEDGER.clear()
    STORE["engine"] = engine = create_engine("sqlite://")
    STORE["effects"] = SqlEffects(engine)
    STORE["effects"].create_schema()


@app.task
def naive_charge(payment_id):
    LEDGER.append(payment_id)
    return payment_id


@singleton_task(app=app, key="payment_id")
def unsafe_charge(payment_id):
    # Under the job's lease, but the write is neither fenced nor idempotent.
    LEDGER.append(payment_id)
    return payment_id


@singleton_task(app=app, key="payment_id")
def charge(payment_id):
    # Fenced (StaleFence once a newer holder wrote) and committed with the job's DONE row.
    with STORE["effects"].transaction(current_job(), f"payment:{payment_id}") as tx:
        if tx.done:
            return tx.result
        LEDGER.append(payment_id)
        tx.result = payment_id
    return tx.result


def newer_holder_writes(fence):
    with GUARD.transaction(STORE["engine"], "payment:7", fence):
        pass
'''

CONFTEST = '''
import pytest

from userproj import tasks

pytest_plugins = ["celery.contrib.pytest"]


@pytest.fixture(autouse=True)
def fresh_ledger():
    tasks.reset()
'''

TEST_FAULTS = '''
import pytest

from userproj.tasks import LEDGER, charge, naive_charge, newer_holder_writes, unsafe_charge


@pytest.fixture(params=["naive", "unsafe", "jobfence"])
def task(request):
    return {"naive": naive_charge, "unsafe": unsafe_charge, "jobfence": charge}[request.param]


def test_a_duplicate_publish_charges_once(jobfence, task):
    jobfence.publish_duplicate(task, 7)
    jobfence.assert_ran_once(task, payment_id=7)
    jobfence.assert_absorbed(task, 7)
    assert LEDGER == [7]


def test_a_redelivery_charges_once(jobfence, task):
    jobfence.redeliver(task, 7)
    jobfence.assert_ran_once(task, 7)
    jobfence.assert_absorbed(task, 7)


def test_a_lost_lease_charges_once(jobfence, task):
    jobfence.lose_lease_during(task, 7)
    jobfence.assert_ran_once(task, 7)
    assert LEDGER == [7]
    jobfence.assert_stale_write_refused(task, 7)


def test_a_stale_fence_refuses_the_write(jobfence, task):
    jobfence.stale_fence_during(task, newer_holder_writes, 7)
    jobfence.assert_stale_write_refused(task, 7)
    assert LEDGER == []


def test_the_lock_server_down_at_begin_charges_once(jobfence, task):
    jobfence.unavailable_at_begin(task, 7)
    jobfence.assert_ran_once(task, 7)
    assert LEDGER == [7]


def test_the_lock_server_down_at_commit_charges_once(jobfence, task):
    results = jobfence.unavailable_at_commit(task, 7)
    jobfence.assert_ran_once(task, 7)
    assert LEDGER == [7]
    assert results[-1].get() == 7


def test_the_lock_server_down_for_a_commit_charges_once(jobfence, task):
    with jobfence.lock_server_down("commit"):
        first = task.apply(args=(7,))
    task.apply(args=(7,), task_id=first.id)  # delivered again, as the worker would
    jobfence.assert_ran_once(task, 7)
    assert LEDGER == [7]


def test_the_commit_unanswered_for_good_is_delivered_again_and_the_body_runs_again(jobfence):
    first, again = jobfence.unavailable_at_commit(unsafe_charge, 8)
    assert first.state == "FAILURE" and "commit outcome unknown" in str(first.result)
    assert again.get() == 8 and LEDGER == [8, 8]
    events = [d.event for d in jobfence.decisions_for(unsafe_charge, 8)]
    assert events == ["started", "redeliver", "started", "done"]
'''

TEST_CALLS = '''
import unittest

from jobfence.testing import JobfenceTestCase
from userproj.app import app
from userproj.tasks import LEDGER, charge


# Two tests charge the same payment: each starts with a fresh lock server.
def test_a_direct_call_apply_and_eager_delay_charge_once(jobfence):
    assert charge(9) == 9
    assert charge.apply(args=(9,)).get() == 9
    app.conf.task_always_eager = True
    try:
        assert charge.delay(9).get() == 9
    finally:
        app.conf.task_always_eager = False
    jobfence.assert_ran_once(charge, 9)
    assert LEDGER == [9]


def test_the_same_payment_again_charges_again(jobfence):
    charge(9)
    jobfence.assert_ran_once(charge, payment_id=9)
    assert [d.event for d in jobfence.decisions] == ["started", "done"]


class ChargeTests(JobfenceTestCase):
    def test_apply_charges_once(self):
        charge.apply(args=(10,))
        charge.apply(args=(10,))
        self.jobfence.assert_ran_once(charge, 10)

    def test_the_same_payment_in_the_next_test_charges_again(self):
        charge.apply(args=(10,))
        self.jobfence.assert_ran_once(charge, 10)
'''

TEST_WORKER = '''
from jobfence import SingletonTask

RUNS = []


def test_duplicates_through_a_real_worker_run_once(jobfence, celery_app, celery_worker):
    @celery_app.task(base=SingletonTask, jobfence_key="order_id", shared=False)
    def ship(order_id):
        RUNS.append(order_id)
        return order_id

    celery_worker.reload()
    results = [ship.delay(5) for _ in range(3)]
    assert [r.get(timeout=30) for r in results][0] == 5
    assert RUNS == [5]
    jobfence.assert_ran_once(ship, 5)
'''

FAULT_TESTS = (
    "test_a_duplicate_publish_charges_once",
    "test_a_redelivery_charges_once",
    "test_a_lost_lease_charges_once",
    "test_a_stale_fence_refuses_the_write",
    "test_the_lock_server_down_at_begin_charges_once",
    "test_the_lock_server_down_at_commit_charges_once",
    "test_the_lock_server_down_for_a_commit_charges_once",
)
#: The helpers whose fault can make a write under the lock alone happen twice (or land after a
#: newer holder's): the unsafe task fails them, by the helper's own assertion.
UNSAFE_FAILS = {
    "test_a_lost_lease_charges_once": "took effect 2 times",
    "test_a_stale_fence_refuses_the_write": "no stale write",
    "test_the_lock_server_down_at_commit_charges_once": "took effect 2 times",
    "test_the_lock_server_down_for_a_commit_charges_once": "took effect 2 times",
}


def plugin_args() -> list[str]:
    """`-p jobfence.testing.plugin` unless the installed jobfence registers it (pytest11)."""
    if any(e.name == "jobfence.testing.plugin" for e in entry_points(group="pytest11")):
        return []
    return ["-p", "jobfence.testing.plugin"]


def test_the_declared_entry_point_names_the_plugin() -> None:
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["pytest11"] == {
        "jobfence.testing.plugin": "jobfence.testing.plugin"
    }


def test_a_users_suite_passes_twice_and_writes_nothing_to_the_lock_server(
    pytester: pytest.Pytester, fresh_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBFENCE_LOCK_URL", fresh_redis.url)
    monkeypatch.setenv("JOBFENCE_KEY_SECRET", "user-project-secret-0123456789abcdef")
    monkeypatch.setenv("COLUMNS", "400")  # the summary lines whole: the failures are read
    pytester.mkpydir("userproj")
    pytester.makepyfile(
        **{"userproj/app": APP, "userproj/tasks": TASKS, "conftest": CONFTEST,
           "test_faults": TEST_FAULTS, "test_calls": TEST_CALLS, "test_worker": TEST_WORKER}
    )  # fmt: skip
    for run in (1, 2):
        result = pytester.runpytest_subprocess(*plugin_args(), "-p", "no:cacheprovider", "-rf")
        out = result.stdout.str()
        failed = dict(re.findall(r"^FAILED test_\w+\.py::(\w+\[\w+\]) - (.*)$", out,
                                 re.MULTILINE))  # fmt: skip
        expected = {f"{name}[naive]" for name in FAULT_TESTS} | {
            f"{name}[unsafe]" for name in UNSAFE_FAILS}  # fmt: skip
        assert set(failed) == expected, f"run {run}:\n{out}"
        for name, words in UNSAFE_FAILS.items():
            assert words in failed[f"{name}[unsafe]"], f"run {run}:\n{out}"
        total = len(FAULT_TESTS) * 3
        result.assert_outcomes(passed=total - len(expected) + 1 + 5, failed=len(expected))
    client = fresh_redis.client()
    try:
        assert client.dbsize() == 0, sorted(client.keys("*"))[:10]
    finally:
        client.close()
