"""Checks that the ``Fleet`` harness starts, observes, faults and always cleans up its workers."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.procs import pid_alive, proc_state
from tests.integration.apps.common import app_env, make_app
from tests.integration.celery_fleet import Fleet, FleetError
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration]

APP = "tests.integration.apps.control_app"


@pytest.fixture
def one_worker(module_redis: RedisServer, tmp_path: Path) -> Iterator[tuple[Fleet, Ledger]]:
    ledger_url = f"redis://{module_redis.host}:{module_redis.port}/1"
    env = app_env(module_redis.url, ledger_url=ledger_url)
    ledger = Ledger.from_url(ledger_url)
    fleet = Fleet(APP, workers=1, concurrency=2, env=env, base_dir=tmp_path / "fleet")
    try:
        yield fleet.start(), ledger
    finally:
        fleet.stop(timeout=5.0)
        ledger.close()


def test_fleet_lifecycle_faults_and_cleanup(
    one_worker: tuple[Fleet, Ledger], module_redis: RedisServer
) -> None:
    fleet, ledger = one_worker
    env = {k: v for k, v in fleet.env.items() if k in ("BROKER_URL", "LEDGER_URL")}
    app = make_app("fleet-check", env)
    seen: set[int] = set()
    mains = [fleet.worker(0).proc]
    try:
        first_main = fleet.main_pid(0)
        children = fleet.child_pids(0)
        seen.update([first_main, *children])
        assert len(children) == 2 and all(fleet.worker_of(p) == 0 for p in children)

        # Never touches a process that is not ours.
        for foreign in (os.getpid(), os.getppid(), 1):
            assert not fleet.owns(foreign)
            with pytest.raises(FleetError):
                fleet.pause(foreign)
            with pytest.raises(FleetError):
                fleet.kill_child(foreign)
        with pytest.raises(FleetError):
            fleet.kill_child(first_main)  # a main process goes through kill_worker()

        # Finds the process running a task, freezes and thaws it.
        job = f"job-{uuid.uuid4().hex[:8]}"
        task_id = app.send_task("control.gated", args=[job, 30.0]).id
        (pid,) = fleet.wait_executing(task_id)
        assert pid in children
        with fleet.paused(pid):
            assert proc_state(pid) == "T"
        ledger.release(job)
        wait_for(lambda: ledger.end_count(job) == 1, 10.0)
        wait_for(lambda: not fleet.executing_pids(task_id), 5.0)
        assert [e.kind for e in fleet.events(task_id)] == ["prerun", "postrun"]

        # SIGKILL of the main process alone takes its pool with it (PR_SET_PDEATHSIG);
        # a restart brings a new worker.
        fleet.kill_worker(0)
        assert not fleet.alive(0)
        wait_for(lambda: not any(pid_alive(p) for p in children), 5.0)
        assert fleet.ensure_running() == [0]
        assert fleet.main_pid(0) != first_main
        mains.append(fleet.worker(0).proc)
        seen.update([fleet.main_pid(0), *fleet.child_pids(0)])

        # A warm shutdown ends the worker and its pool, on its own (no SIGKILL). It takes
        # about 2 s on a quiet machine and passed 10 s under the whole suite's load, so the
        # bound is generous: what is asserted is that it ends, not how fast.
        assert fleet.stop_worker(0, timeout=45.0)
        assert not fleet.alive(0)
        fleet.start()
        mains.append(fleet.worker(0).proc)
        seen.update([fleet.main_pid(0), *fleet.child_pids(0)])
    finally:
        app.close()
        fleet.stop(timeout=5.0)
    # Every process it ever started is gone, pool processes included.
    assert not [p for p in seen if pid_alive(p)]
    # ... and every main process was reaped (pool children are reaped by init).
    assert len(mains) == 3 and all(proc.returncode is not None for proc in mains)
