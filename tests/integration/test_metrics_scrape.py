"""A real worker's /metrics (JOBFENCE_METRICS_PORT), scraped during and after a run of jobs.

(A threads-pool worker's endpoint runs in the README's "Live metrics" example.)

Under the prefork pool each job runs in one of two child processes; the endpoint, served by
the main process, must report the counts of both. The control: each child's own counts
(its file) are only part of the total the endpoint shows.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import socket
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from devstack.redis_server import free_port
from tests.integration.apps.common import app_env, make_app
from tests.integration.apps.metrics_app import BUSY_SUFFIX, SEMAPHORE, SLOTS, WORK_TASK
from tests.integration.celery_fleet import FleetError, FleetFactory
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.metrics_app"
JOBS = 8
BODY = 0.25  # seconds each job works
BUSY = 1.6  # the job sent twice works this long: the copy finds it busy, heartbeats run
REPLAYED = 3
_mmap: Any = importlib.import_module("prometheus_client.mmap_dict")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def runs(text: str) -> float:
    return value(text, "jobfence_executions_total", task=WORK_TASK, outcome="done")


def _pid(path: str) -> int | None:
    tail = Path(path).stem.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def own_runs(path: str) -> float:
    """One process's `done` count, read from its own file (not through the endpoint)."""
    total = 0.0
    for key, count, _ts, _pos in _mmap.MmapedDict.read_all_values_from_file(path):
        _metric, name, labels, _help = json.loads(key)
        if name == "jobfence_executions_total" and labels.get("outcome") == "done":
            total += count
    return total


def test_a_prefork_worker_serves_metrics_of_all_its_pool_processes_while_it_runs(
    module_redis: RedisServer, fleet_factory: FleetFactory
) -> None:
    port = free_port()
    prefix = f"mx{uuid.uuid4().hex[:8]}"
    env = app_env(
        module_redis.db_url(3),
        visibility_timeout=60,
        LOCK_URL=module_redis.db_url(0),
        KEY_PREFIX=prefix,
        METRICS_PORT=str(port),
    )
    fleet = fleet_factory(APP, env=env, workers=1, concurrency=2, pool="prefork")
    client: Celery = make_app("metrics-client", env)
    secret = f"arg-{uuid.uuid4().hex}"  # argument text that must never reach a label
    jobs = [f"{secret}-{i}" for i in range(JOBS)]
    busy = secret + BUSY_SUFFIX

    seen: list[float] = []
    held: list[float] = []  # slots of the semaphore the busy job holds while it works
    done = threading.Event()

    def poll() -> None:  # scrapes while the jobs run
        deadline = time.monotonic() + 30
        while not done.is_set() and time.monotonic() < deadline:
            text = scrape(port)
            seen.append(runs(text))
            held.append(value(text, "jobfence_semaphore_slots_held", semaphore=SEMAPHORE))
            time.sleep(0.05)

    assert runs(scrape(port)) == 0  # served before any job
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(2):
            client.send_task(WORK_TASK, args=[busy, BUSY])
        for job in jobs:
            client.send_task(WORK_TASK, args=[job, BODY])
        wait_for(lambda: seen and seen[-1] >= JOBS + 1, timeout=30, interval=0.05,
                 message=lambda: f"runs seen {seen[-5:]}\n" + fleet.logs(30))  # fmt: skip
    finally:
        done.set()
        poller.join(10)
    assert any(0 < n < JOBS + 1 for n in seen), f"never scraped mid-run: {seen}"
    assert seen == sorted(seen), "a counter went backwards"
    assert max(held) == 1, f"the busy job's slot was never seen held: {held}"
    for job in jobs[:REPLAYED]:  # answered from the stored result
        client.send_task(WORK_TASK, args=[job, BODY])
    task = {"task": WORK_TASK}
    wait_for(
        lambda: value(scrape(port), "jobfence_idempotent_replays_total", **task) >= REPLAYED,
        timeout=20,
        interval=0.05,
        message="replays never counted",
    )
    text = scrape(port)
    assert runs(text) == JOBS + 1  # the busy job ran once
    assert value(text, "jobfence_idempotent_replays_total", **task) == REPLAYED
    assert value(text, "jobfence_conflicts_total", policy="skip", **task) == 1
    assert value(text, "jobfence_acquire_wait_seconds_count", **task) == JOBS + 1
    assert value(text, "jobfence_acquire_wait_seconds_bucket", le="+Inf", **task) == JOBS + 1
    assert value(text, "jobfence_heartbeat_seconds_count", backend="redis") >= 1
    assert "# TYPE jobfence_acquire_wait_seconds histogram" in text
    assert value(text, "jobfence_semaphore_slots_held", semaphore=SEMAPHORE) == 0  # given back
    assert value(text, "jobfence_semaphore_limit", semaphore=SEMAPHORE) == SLOTS
    assert secret not in text and prefix not in text  # no argument, no key

    main = fleet.main_pid(0)
    mine = os.path.join(tempfile.gettempdir(), f"jobfence-metrics-{main}-*")
    node_dirs = glob.glob(mine)
    # Control: every pool process counted only its own runs; the endpoint sums them.
    assert len(node_dirs) == 1
    per_child = {
        pid: own_runs(f)
        for f in glob.glob(os.path.join(node_dirs[0], "counter_*.db"))
        if (pid := _pid(f)) is not None and pid != main
    }
    ran = {pid: n for pid, n in per_child.items() if n}
    assert len(ran) == 2, f"both children should have run jobs: {per_child}"
    assert all(n < JOBS + 1 for n in ran.values())
    assert sum(ran.values()) == JOBS + 1

    # A child killed outright (no shutdown signal runs in it): its runs still count,
    # and the next scrapes fold its files into one archive file.
    victim = min(ran)
    fleet.kill_child(victim)
    child_file = os.path.join(node_dirs[0], f"counter_{victim}.db")

    def folded() -> bool:
        return runs(scrape(port)) == JOBS + 1 and not os.path.exists(child_file)

    wait_for(folded, timeout=15, message="the killed child's counts were not settled")
    assert os.path.exists(os.path.join(node_dirs[0], "counter_archive.db"))
    fleet.stop()
    assert glob.glob(mine) == []  # removed at shutdown


def test_a_worker_whose_metrics_port_is_taken_refuses_to_start(
    module_redis: RedisServer, fleet_factory: FleetFactory
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = app_env(
            module_redis.db_url(5),
            visibility_timeout=60,
            LOCK_URL=module_redis.db_url(0),
            KEY_PREFIX=f"mx{uuid.uuid4().hex[:8]}",
            METRICS_PORT=str(port),
        )
        with pytest.raises(FleetError) as refused:
            fleet_factory(APP, env=env, workers=1, concurrency=1, ready_timeout=20)
    message = str(refused.value)
    assert "JOBFENCE_METRICS_PORT" in message and str(port) in message
    assert "refusing to start the worker" in message
