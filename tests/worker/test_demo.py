"""The demo: a small real run passes its own report, and the ledger check catches every breach."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import insert, update

from demo.app import (
    RECONCILE_ENTRY,
    RECONCILE_TASK,
    SHOP_MODULES,
    create_shop_app,
)
from demo.shop.ledger import accounts, payments, reservations, stock
from demo.storm import (
    DemoOptions,
    Job,
    Report,
    check_ledger,
    count_events,
    plan_storm,
    seed_ledger,
)
from jobfence.config import Settings
from jobfence.tasks import runtime_for
from jobfence.tasks.effects import jobs as jobs_table
from jobfence.tasks.effects import make_engine

REPO_ROOT = Path(__file__).resolve().parents[2]
REPORT_KEYS = {
    "published",
    "distinct_jobs",
    "executions",
    "duplicates_suppressed",
    "stale_writes_refused",
    "double_effects",
    "lost_jobs",
    "oversold",
    "elapsed_s",
}


def test_the_shop_app_names_its_task_modules_and_its_nightly_reconciliation() -> None:
    """What create_app() used to default to (issue 32, item 6), the demo names itself."""
    settings = Settings(lock_url="redis://127.0.0.1:7001/0")  # nothing is contacted
    app = create_shop_app(settings, reconcile_at="15 4 * * *")
    try:
        assert list(app.conf.include) == list(SHOP_MODULES)
        entry = app.conf.beat_schedule[RECONCILE_ENTRY]
        assert entry["task"] == RECONCILE_TASK
        assert entry["schedule"].hour == {4} and entry["schedule"].minute == {15}
    finally:
        runtime_for(app).close()
    app = create_shop_app(settings, reconcile_at=None)
    try:
        assert app.conf.beat_schedule == {}
    finally:
        runtime_for(app).close()


def test_a_small_demo_run_passes_and_prints_one_json_object(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobfence",
            "demo",
            "--jobs",
            "30",
            "--publishes",
            "150",
            "--workers",
            "3",
            "--json",
            "--log",
            str(tmp_path / "fleet.log"),
        ],
        cwd=REPO_ROOT,
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = json.loads(proc.stdout)
    assert set(report) >= REPORT_KEYS
    assert report["published"] == 150
    assert report["distinct_jobs"] == 30
    assert report["double_effects"] == 0
    assert report["lost_jobs"] == 0
    assert report["oversold"] == 0
    assert report["effects_per_job_min"] == report["effects_per_job_max"] == 1
    assert report["executions"] >= 30  # every job ran at least once, some more (retries)
    assert report["duplicates_suppressed"] > 0  # 120 duplicate messages met the gate
    assert report["killed_worker"] and report["frozen_worker"]
    assert report["lock_restarts"] == 1  # the lock server lost its data mid-storm, and yet...
    assert report["conflicts_refused"] == report["conflicts_probed"] > 0


def test_the_storm_publishes_every_job_at_least_once_with_duplicates() -> None:
    storm = plan_storm(DemoOptions(jobs=50, publishes=400, seed=3))
    counts = Counter(job for job, _ in storm.publishes)
    assert len(storm.publishes) == 400
    assert set(counts) == set(storm.jobs)
    assert max(counts.values()) > 1
    assert any(countdown for _, countdown in storm.publishes)
    assert plan_storm(DemoOptions(jobs=50, publishes=400, seed=3)).publishes == storm.publishes


@pytest.fixture
def ledger(tmp_path: Path) -> tuple[object, list[Job], dict[Job, str], object]:
    storm = plan_storm(DemoOptions(jobs=12, publishes=12, seed=5))
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    seed_ledger(engine, storm)
    keys = {job: f"key-{i}" for i, job in enumerate(storm.jobs)}
    # A correct outcome: every payment charged once, every order reserved once.
    with engine.begin() as conn:
        for i, job in enumerate(storm.jobs):
            if job.task.endswith("charge"):
                pid, account, amount, currency = job.args
                conn.execute(
                    insert(payments).values(
                        payment_id=pid,
                        account=account,
                        amount_cents=amount,
                        currency=currency,
                        balance_after_cents=0,
                        fence=i + 1,
                        created_at=_now(),
                    )
                )
                conn.execute(
                    update(accounts)
                    .where(accounts.c.account == account)
                    .values(balance_cents=accounts.c.balance_cents - amount)
                )
                status = "charged"
            else:
                oid, sku, qty = job.args
                conn.execute(
                    insert(reservations).values(
                        order_id=oid, sku=sku, qty=qty, fence=i + 1, created_at=_now()
                    )
                )
                conn.execute(
                    update(stock).where(stock.c.sku == sku).values(quantity=stock.c.quantity - qty)
                )
                status = "reserved"
            conn.execute(
                insert(jobs_table).values(
                    job_key=keys[job],
                    state="DONE",
                    fingerprint="f",
                    fence=i + 1,
                    finished_at=0.0,
                    result=json.dumps({"status": status}),
                )
            )
    return engine, storm.jobs, keys, storm


def _now() -> object:
    from demo.shop.ledger import now

    return now()


def test_the_ledger_check_passes_a_correct_ledger(ledger) -> None:  # type: ignore[no-untyped-def]
    engine, _, keys, storm = ledger
    report = Report(conflicts_probed=0)
    check_ledger(engine, storm, keys, report)
    assert report.passed, report.problems
    assert report.effects_per_job_min == report.effects_per_job_max == 1


def test_the_ledger_check_catches_a_double_charge(ledger) -> None:  # type: ignore[no-untyped-def]
    engine, jobs, keys, storm = ledger
    pay = next(j for j in jobs if j.task.endswith("charge"))
    with engine.begin() as conn:  # the same charge debited a second time
        conn.execute(
            update(accounts)
            .where(accounts.c.account == pay.args[1])
            .values(balance_cents=accounts.c.balance_cents - pay.args[2])
        )
    report = Report()
    check_ledger(engine, storm, keys, report)
    assert report.double_charges >= 1
    assert not report.passed


def test_the_ledger_check_catches_an_oversold_sku(ledger) -> None:  # type: ignore[no-untyped-def]
    engine, jobs, keys, storm = ledger
    order = next(j for j in jobs if j.task.endswith("reserve"))
    with engine.begin() as conn:  # stock taken without a reservation row
        conn.execute(
            update(stock).where(stock.c.sku == order.args[1]).values(quantity=stock.c.quantity - 1)
        )
    report = Report()
    check_ledger(engine, storm, keys, report)
    assert report.oversold >= 1
    assert not report.passed


def test_the_ledger_check_catches_a_lost_job(ledger) -> None:  # type: ignore[no-untyped-def]
    engine, jobs, keys, storm = ledger
    with engine.begin() as conn:
        conn.execute(jobs_table.delete().where(jobs_table.c.job_key == keys[jobs[0]]))
    report = Report()
    check_ledger(engine, storm, keys, report)
    assert report.lost_jobs == 1
    assert not report.passed


def test_the_ledger_check_catches_a_declined_job_with_a_ledger_row(ledger) -> None:  # type: ignore[no-untyped-def]
    engine, jobs, keys, storm = ledger
    pay = next(j for j in jobs if j.task.endswith("charge"))
    with engine.begin() as conn:  # says declined, yet the money moved
        conn.execute(
            jobs_table.update()
            .where(jobs_table.c.job_key == keys[pay])
            .values(result=json.dumps({"status": "declined"}))
        )
    report = Report()
    check_ledger(engine, storm, keys, report)
    assert report.double_effects == 1
    assert not report.passed


def test_events_are_counted_only_for_the_demo_jobs() -> None:
    report = Report()
    events = {
        "started": Counter({"a": 2, "b": 1, "other": 5}),
        "conflict": Counter({"a": 3}),
        "replayed": Counter({"b": 4}),
        "stale": Counter({"a": 1}),
        "released": Counter({"a": 1}),
    }
    count_events(events, {"a", "b"}, report)
    assert (
        report.executions,
        report.duplicates_suppressed,
        report.stale_writes_refused,
        report.retries,
    ) == (3, 7, 1, 1)


def test_without_redis_server_the_demo_says_how_to_install_it_in_one_line(tmp_path: Path) -> None:
    """Issue 31, item 5: on a machine with no redis-server the demo printed a 28-line
    traceback. Now one line names the package and the flags for servers of one's own;
    `make demo` itself installs it first (.ci/setup --demo)."""
    bin_dir = tmp_path / "bin"  # a PATH with no redis-server on it
    bin_dir.mkdir()
    env = {**os.environ, "PATH": str(bin_dir)}
    env.pop("JOBFENCE_BROKER_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "jobfence", "demo", "--jobs", "2"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "redis-server" in lines[0], lines
    assert "apt-get install redis-server" in lines[0] and "--broker" in lines[0]


def test_make_demo_installs_redis_server_when_it_is_missing() -> None:
    """The README's `make demo` runs `.ci/setup --demo`, whose step installs redis-server."""
    root = Path(__file__).resolve().parents[2]
    makefile = (root / "Makefile").read_text()
    demo = makefile.split("\ndemo:\n", 1)[1].split("\n\n", 1)[0]
    assert "./.ci/setup --demo" in demo
    setup = (root / ".ci" / "setup").read_text()
    step = setup.split("--demo ]]; then", 1)[1].split("\nfi\n", 1)[0]
    assert "apt-get install" in step and "redis-server" in step
