"""@singleton_task(concurrency=2, concurrency_key=["account"]) on a fleet of real workers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.integration.apps.common import app_env
from tests.integration.apps.semaphore_app import LIMIT, SLOT_WAIT, create_app
from tests.integration.celery_fleet import FleetFactory
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration]

APP = "tests.integration.apps.semaphore_app"
#: account -> (jobs, seconds each holds), published in this order: c's jobs outlast a
#: waiter's SLOT_WAIT well, so its third job finds no slot in time and is published again.
JOBS = {"c": (3, SLOT_WAIT * 2.5), "a": (12, 0.3), "b": (4, 0.3)}


@pytest.fixture(scope="module")
def fleet_env(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[dict[str, str]]:
    """One fleet for the module: 2 workers x 3 pool processes, locks on the broker's Redis."""
    ledger_url = f"redis://{module_redis.host}:{module_redis.port}/1"
    env = app_env(module_redis.url, ledger_url=ledger_url, LOCK_URL=module_redis.url)
    fleet_factory(APP, env=env, workers=2, concurrency=3)
    yield env


def _run(task_name: str, env: dict[str, str], jobs: dict[str, tuple[int, float]]) -> Ledger:
    ledger = Ledger.from_url(env["LEDGER_URL"])
    ledger.reset()
    app = create_app(env, name="semaphore-client")
    run = uuid.uuid4().hex[:6]
    for acct, (n, hold) in jobs.items():
        for i in range(n):
            app.tasks[task_name].delay(acct, f"{run}-{acct}{i}", hold)
    wait_for(
        lambda: all(ledger.end_count(f"account-{a}") == n for a, (n, _) in jobs.items()),
        timeout=45,
        interval=0.1,
        message=lambda: "; ".join(ledger.summary(f"account-{a}") for a in jobs),
    )
    for acct, (n, _) in jobs.items():
        for i in range(n):
            job_id = f"{run}-{acct}{i}"
            assert ledger.effect_count(job_id) == 1, ledger.summary(job_id)
    return ledger


def test_at_most_two_jobs_of_an_account_run_at_once_and_each_runs_once(
    fleet_env: dict[str, str],
) -> None:
    ledger = _run("semaphore.account_job", fleet_env, JOBS)
    for acct in JOBS:
        most = ledger.max_concurrent(f"account-{acct}")
        assert most <= LIMIT, f"account {acct}: {most} jobs ran at once"
    # With 6 pool processes and 12 jobs queued, account a used both of its slots.
    assert ledger.max_concurrent("account-a") == LIMIT
    fences = [s["fence"] for s in ledger.starts("account-a")]
    assert len(set(fences)) == len(fences) == JOBS["a"][0]  # one job grant each, none twice
    requeued = [
        o for s in ledger.starts("account-c") for o in ledger.outcomes(s["job"])
        if o["state"] == "IGNORED"
    ]  # fmt: skip
    assert requeued, "no job of account c was published again while both slots were busy"


def test_control_without_concurrency_the_same_jobs_overlap(fleet_env: dict[str, str]) -> None:
    ledger = _run("semaphore.unlimited", fleet_env, {"a": JOBS["a"]})
    assert ledger.max_concurrent("account-a") > LIMIT
