"""Publish on commit, measured as issue 34 asks: web-like processes commit or roll back orders
at random, some are SIGKILLed between their commit and their publish (or between the publish
and its mark), and the broker is cut off from them for a window. Through the outbox, every
committed order is fulfilled exactly once and no rolled-back one is; the control (an
after-commit `apply_async`, what Celery's `delay_on_commit` does) loses the killed ones.

Real `celery worker` processes (running the outbox relay), a private redis-server broker
(reached by the web processes through a proxy the test cuts), a scratch PostgreSQL database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from jobfence.tasks.effects import make_engine, outbox
from tests.integration.apps.common import app_env
from tests.integration.apps.outbox_app import create_schema, fulfilments, orders
from tests.integration.celery_fleet import Fleet, FleetFactory
from tests.proxy import FaultProxy
from tests.servers import HOST, POSTGRES_ADMIN_URL, PostgresDatabase, RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.outbox_app"
REPO_ROOT = Path(__file__).resolve().parents[2]
ORDERS = 10  # per web process
SETTLE = 90.0  # seconds the fleet may take to drain on a loaded two-core machine
#: (die, how many web processes) per batch and mode: killed before the publish, after it.
BATCH = (("before", 1), ("after", 1), ("none", 2))


@dataclass
class Storm:
    fleet: Fleet
    engine: sa.Engine
    env: dict[str, str]  # the fleet's
    web_env: dict[str, str]  # the web processes': the broker through the proxy
    proxy: FaultProxy
    broker: redis.Redis


@pytest.fixture(scope="module")
def storm(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[Storm]:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    with PostgresDatabase() as db, FaultProxy(module_redis.host, module_redis.port) as proxy:
        create_schema(db.url)
        env = app_env(module_redis.db_url(0), LOCK_URL=module_redis.db_url(1),
                      DATABASE_URL=db.url, VISIBILITY_TIMEOUT="30")  # fmt: skip
        fleet = fleet_factory(APP, env=env, workers=2, concurrency=2)
        web_env = {
            **os.environ, **env, "PYTHONPATH": str(REPO_ROOT),
            "BROKER_URL": f"redis://{HOST}:{proxy.port}/0",
            # A publish into the cut fails within seconds instead of retrying for long.
            "BROKER_TRANSPORT_OPTIONS": json.dumps({"socket_timeout": 0.5,
                                                    "socket_connect_timeout": 0.5}),
        }  # fmt: skip
        engine = make_engine(db.url)
        broker = module_redis.client()
        try:
            yield Storm(fleet, engine, env, web_env, proxy, broker)
        finally:
            broker.close()
            engine.dispose()


def run_batch(
    storm: Storm, mode: str, seed: int, *, held: bool = False
) -> list[subprocess.Popen[bytes]]:
    """A batch of web processes; each starts publishing on "go" (`held`: when `go()` says)."""
    procs = []
    for die, n in BATCH:
        for _ in range(n):
            seed += 1
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.integration.outbox_web", mode, str(seed),
                 str(ORDERS), die],
                env=storm.web_env, cwd=REPO_ROOT, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            ))  # fmt: skip
    if not held:
        go(procs)
    return procs


def go(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.close()
        p.stdin = None  # communicate() has no input to send, and must not flush a closed file


def wait_all(procs: list[subprocess.Popen[bytes]]) -> tuple[list[int], str]:
    """The exit codes and the stderr of `procs`."""
    errs = [p.communicate(timeout=120)[1].decode(errors="replace") for p in procs]
    return [p.returncode for p in procs], "".join(errs)


def unsent(storm: Storm) -> int:
    with storm.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).where(outbox.c.sent_at.is_(None))) or 0)


def tally(storm: Storm, mode: str) -> tuple[set[str], Counter[str]]:
    """(orders committed, runs per order) of `mode`."""
    with storm.engine.connect() as conn:
        committed = set(conn.scalars(sa.select(orders.c.id).where(orders.c.mode == mode)))
        runs = Counter(conn.scalars(sa.select(fulfilments.c.order_id)
                                    .where(fulfilments.c.mode == mode)))  # fmt: skip
    return committed, runs


def settle(storm: Storm, mode: str, done: bool) -> tuple[set[str], Counter[str]]:
    """Poll until every committed order ran (`done`), else until the runs stop changing."""
    deadline = time.monotonic() + SETTLE
    last: Counter[str] | None = None
    steady_since = time.monotonic()
    while True:
        committed, runs = tally(storm, mode)
        if done and committed <= set(runs):
            return committed, runs
        if runs != last:
            last, steady_since = runs, time.monotonic()
        elif not done and time.monotonic() - steady_since > 5.0:
            return committed, runs
        if time.monotonic() > deadline:
            return committed, runs
        time.sleep(0.2)


def storm_of(storm: Storm, mode: str) -> tuple[list[int], str]:
    """Two batches of web processes; the second runs wholly while the broker is cut off
    from them (from when all of them are ready until the last has exited: every publish of
    theirs meets the cut, however slow the machine). The exit codes and their stderr."""
    codes, errs = wait_all(run_batch(storm, mode, seed=100))
    procs = run_batch(storm, mode, seed=200, held=True)
    for p in procs:  # each has built its app and connected to the database
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    with storm.proxy.partitioned():
        go(procs)  # they publish from now on, each publish into the cut
        more, more_errs = wait_all(procs)
    return codes + more, errs + more_errs


def test_control_an_after_commit_publish_loses_the_jobs_of_a_killed_process(
    storm: Storm,
) -> None:
    codes, errs = storm_of(storm, "naive")
    assert codes.count(-9) >= 2, codes  # the processes meant to die did
    failed = errs.count("publish failed")
    assert failed, f"no publish met the cut broker:\n{errs[-2000:]}"
    committed, runs = settle(storm, "naive", done=False)
    lost = committed - set(runs)
    assert len(lost) > 2, "the control lost no more than the killed: the cut did nothing"
    print(f"control: {len(committed)} committed, {len(lost)} never ran ({failed} publishes "
          f"failed in the cut), {sum(n > 1 for n in runs.values())} ran twice")  # fmt: skip


def test_through_the_outbox_every_committed_order_runs_once_and_no_rollback_runs(
    storm: Storm,
) -> None:
    codes, errs = storm_of(storm, "outbox")
    assert codes.count(-9) >= 2, codes
    failed = errs.count("the outbox relay sends it")
    assert failed, f"no publish met the cut broker:\n{errs[-2000:]}"
    committed, runs = settle(storm, "outbox", done=True)
    assert committed, "nothing committed"
    assert committed - set(runs) == set(), f"lost: {sorted(committed - set(runs))}"
    assert set(runs) - committed == set(), "a rolled-back order ran"
    # The relay sends what no one marked sent (a process killed after its publish too:
    # a second copy under the same task id, which the gate must absorb).
    wait_for(lambda: unsent(storm) == 0, SETTLE, message="outbox rows never sent")
    storm.fleet.wait_idle(storm.broker, timeout=SETTLE)
    _, runs = tally(storm, "outbox")
    twice = {order: n for order, n in runs.items() if n > 1}
    assert twice == {}, f"ran more than once: {twice}"
    with storm.engine.connect() as conn:
        rows = conn.scalar(sa.select(sa.func.count()).select_from(outbox))
    assert rows == len(committed)
    print(f"outbox: {len(committed)} committed, all ran once ({failed} publishes failed in "
          "the cut, sent by the relay)")  # fmt: skip
