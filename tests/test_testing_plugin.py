"""The `jobfence` pytest fixture in a user's own project: the user's suite (a naive Celery task
beside a `@singleton_task`, run with pytester in a subprocess) run twice against a private
Redis configured as its lock server. Each fault helper fails the naive task's test and passes
the jobfence task's; tests and runs do not leak into each other; nothing reaches Redis."""

from __future__ import annotations

import re
from importlib.metadata import entry_points

import pytest

from jobfence.worker.redis_server import RedisServer

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
from userproj.app import app

LEDGER: list[int] = []  # the charges, in order
GUARD = SqlFenceGuard()
STORE = {}


def reset() -> None:
    LEDGER.clear()
    STORE["engine"] = engine = create_engine("sqlite://")
    GUARD.create_schema(engine)


@app.task
def naive_charge(payment_id):
    LEDGER.append(payment_id)
    return payment_id


@singleton_task(app=app, key="payment_id")
def charge(payment_id):
    # The fenced write: refused (StaleFence) once a newer holder of the job has written.
    with GUARD.transaction(STORE["engine"], f"payment:{payment_id}", current_job().fence):
        LEDGER.append(payment_id)
    return payment_id


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

from userproj.tasks import LEDGER, charge, naive_charge, newer_holder_writes


@pytest.fixture(params=["naive", "jobfence"])
def task(request):
    return {"naive": naive_charge, "jobfence": charge}[request.param]


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
    jobfence.unavailable_at_commit(task, 7)
    jobfence.assert_ran_once(task, 7)
    assert LEDGER == [7]
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
)


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
    pytester.mkpydir("userproj")
    pytester.makepyfile(
        **{"userproj/app": APP, "userproj/tasks": TASKS, "conftest": CONFTEST,
           "test_faults": TEST_FAULTS, "test_calls": TEST_CALLS, "test_worker": TEST_WORKER}
    )  # fmt: skip
    for run in (1, 2):
        result = pytester.runpytest_subprocess(*plugin_args(), "-p", "no:cacheprovider", "-rf")
        out = result.stdout.str()
        failed = set(re.findall(r"^FAILED test_\w+\.py::(\w+\[\w+\])", out, re.MULTILINE))
        assert failed == {f"{name}[naive]" for name in FAULT_TESTS}, f"run {run}:\n{out}"
        result.assert_outcomes(passed=6 + 5, failed=6)
    client = fresh_redis.client()
    try:
        assert client.dbsize() == 0, sorted(client.keys("*"))[:10]
    finally:
        client.close()
