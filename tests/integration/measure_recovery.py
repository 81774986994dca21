"""Recovery time per broker and lock lifetime: a worker SIGKILLed or SIGTERMed mid-job.

Run from a checkout's root (it starts its own redis-server; RabbitMQ is the one at
``RABBITMQ_URL``, default ``amqp://guest:guest@127.0.0.1:5672//``, on a queue of its own)::

    python -m tests.integration.measure_recovery [--runs 3] [--brokers redis,rabbitmq]

The fleet, app and ledger are those of ``tests/integration/test_crash_recovery.py``: two
workers of ``tests.integration.apps.crash_app`` (``jobfence.setup``, lease TTL 2 s), its gated
``crash.fenced`` task declared with each lifetime (``LIFETIME``). SIGKILL: the time from the
kill of the worker whose body started to the job's effect on the surviving worker (the gate
opened at the kill). SIGTERM (a supervisor's restart, warm shutdown): the time from the
signal to the job's effect, and where it ran. Each run also counts the body's starts and
effects, one TTL after the effect: a job run twice or lost is reported, not hidden.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tests.integration.apps.common import app_env, make_app
from tests.integration.celery_fleet import Fleet
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

APP = "tests.integration.apps.crash_app"
TTL = 2.0
VISIBILITY_TIMEOUT = 120.0  # far beyond a run: on Redis only custody can bring a message back
LIFETIMES = ("finish", "start", "unique_for=10")
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@dataclass
class Row:
    broker: str
    lifetime: str
    signal: str
    seconds: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def cell(self) -> str:
        if not self.seconds:
            return "no run"
        s = sorted(self.seconds)
        return (f"{s[0]:.2f} / {statistics.median(s):.2f} / {s[-1]:.2f} s "
                f"(n={len(s)})")  # fmt: skip


@dataclass
class Rig:
    fleet: Fleet
    ledger: Ledger
    send: Callable[..., Any]  # the client app's send_task

    def start_job(self) -> tuple[str, str, int]:
        """Publish a gated job; wait until a worker's body started it. (job, task id, worker)"""
        job = f"job-{uuid.uuid4().hex[:12]}"
        task_id = str(self.send("crash.fenced", args=[job]).id)
        (pid,) = self.fleet.wait_executing(task_id, count=1, timeout=30.0)
        wait_for(lambda: self.ledger.start_count(job) >= 1, 30.0,
                 message=lambda: self.ledger.summary(job))  # fmt: skip
        index = self.fleet.worker_of(pid)
        assert index is not None
        return job, task_id, index

    def settle(self, job: str, since: float, window: float) -> tuple[float, str]:
        """Wait for the job's effect; return its delay after `since` and who ran it."""
        wait_for(
            lambda: self.ledger.effect_count(job) >= 1,
            window,
            interval=0.02,
            message=lambda: f"lost?\n{self.ledger.summary(job)}\n{self.fleet.logs(20)}",
        )
        effect = self.ledger.effects(job)[0]
        return float(effect["t"]) - since, str(effect["worker"]).split("@")[0]

    def check_once(self, job: str) -> str:
        time.sleep(TTL)  # a second run would have come by now
        effects, starts = self.ledger.effect_count(job), self.ledger.start_count(job)
        return "" if effects == 1 else f"{job}: {effects} effects, {starts} starts"


def kill_run(rig: Rig, row: Row) -> None:
    job, _, index = rig.start_job()
    killed_at = time.time()
    rig.fleet.kill_worker(index)
    rig.ledger.release(job)  # the copy that comes back runs through
    took, ran_on = rig.settle(job, killed_at, 60.0)
    row.seconds.append(took)
    if ran_on == f"w{index}":
        row.notes.append(f"{job}: ran on the killed worker's slot")
    if note := rig.check_once(job):
        row.notes.append(note)
    rig.fleet.ensure_running()


def term_run(rig: Rig, row: Row) -> None:
    job, _, index = rig.start_job()
    termed_at = time.time()
    rig.fleet.begin_warm_shutdown(index)
    wait_for(lambda: rig.fleet.shutting_down(index) or rig.fleet.worker(index).exited, 30.0)
    rig.ledger.release(job)  # the body, still running, finishes during the warm shutdown
    took, ran_on = rig.settle(job, termed_at, 60.0)
    row.seconds.append(took)
    starts = rig.ledger.start_count(job)
    row.notes.append(f"ran on {'the stopping' if ran_on == f'w{index}' else 'the other'} "
                     f"worker, {starts} start(s)")  # fmt: skip
    if note := rig.check_once(job):
        row.notes.append(note)
    wait_for(lambda: rig.fleet.worker(index).exited, 30.0, message="worker did not stop")
    rig.fleet.ensure_running()


@contextmanager
def rig_for(broker: str, lifetime: str, redis: RedisServer, db: int) -> Iterator[Rig]:
    base = f"redis://{redis.host}:{redis.port}"
    queue = f"jf-measure-{uuid.uuid4().hex[:8]}"
    extra = {"LEASE_TTL": repr(TTL), "LIFETIME": lifetime, "LOCK_URL": f"{base}/{db + 2}"}
    if broker == "redis":
        broker_url = f"{base}/{db}"
    else:
        broker_url = RABBITMQ_URL
        extra["QUEUE"] = queue
    env = app_env(broker_url, ledger_url=f"{base}/{db + 1}", visibility_timeout=VISIBILITY_TIMEOUT)
    env.update(extra)
    client = make_app("measure-client", env)
    if broker != "redis":
        client.conf.task_default_queue = queue
    ledger = Ledger.from_url(f"{base}/{db + 1}")
    fleet = Fleet(APP, env=env, workers=2, concurrency=1,
                  base_dir=tempfile.mkdtemp(prefix="jobfence-measure-"))  # fmt: skip
    try:
        fleet.start()
        yield Rig(fleet, ledger, client.send_task)
    finally:
        fleet.stop(timeout=5.0)
        ledger.close()
        if broker != "redis":  # the queue of our own goes with us
            with client.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
        client.close()


def measure(brokers: Sequence[str], runs: int, terms: int) -> list[Row]:
    rows: list[Row] = []
    with RedisServer() as redis:
        for b, broker in enumerate(brokers):
            for n, lifetime in enumerate(LIFETIMES):
                kill, term = Row(broker, lifetime, "SIGKILL"), Row(broker, lifetime, "SIGTERM")
                with rig_for(broker, lifetime, redis, db=(b * 3 + n) % 5 * 3) as rig:
                    for _ in range(runs):
                        kill_run(rig, kill)
                    for _ in range(terms):
                        term_run(rig, term)
                rows += [kill, term]
                for row in (kill, term):
                    print(f"{row.broker:8} {row.lifetime:14} {row.signal:7} {row.cell()}  "
                          f"raw={[round(s, 2) for s in row.seconds]} "
                          f"{'; '.join(sorted(set(row.notes)))}", flush=True)  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="SIGKILL runs per cell")
    parser.add_argument("--terms", type=int, default=2, help="SIGTERM runs per cell")
    parser.add_argument("--brokers", default="redis,rabbitmq")
    args = parser.parse_args(argv)
    rows = measure(args.brokers.split(","), args.runs, args.terms)
    print("\n| broker | lifetime | signal | min / median / max |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row.broker} | `{row.lifetime}` | {row.signal} | {row.cell()} |")
    return 1 if any("effects" in note for row in rows for note in row.notes) else 0


if __name__ == "__main__":
    sys.exit(main())
