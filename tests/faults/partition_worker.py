"""A worker for the partition fault test: holds a job's lock, waits for a go file, then writes.

Run inside a network namespace by tests/faults/test_partition.py:

    python -m tests.faults.partition_worker --mode jobfence --url redis://10.x.y.1:PORT/0 \\
        --key job:row-b --ttl 2 --events EVENTS.jsonl --go GO_FILE

It appends one JSON object per line to EVENTS (holding, lost, write refused or done, the
outcome), each with the time on this host's monotonic clock, which every process shares.
`--mode jobfence` runs the job through the Executor and writes through the Redis fence
guard; `--mode naive` takes a SET NX lock (no keeper, no fence) and writes directly.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from jobfence.locks.acquire import Backoff
from jobfence.locks.backends.redis import RedisBackend
from jobfence.locks.errors import StaleFence
from jobfence.locks.guards import RedisFenceGuard
from jobfence.locks.keeper import LeaseKeeper
from jobfence.tasks.context import JobContext
from jobfence.tasks.executor import Executor, JobSpec

RESOURCE = "row-b:ledger"
LEDGER = "row-b:entries"
GO_DEADLINE = 120.0  # seconds a worker waits for its go file before giving up


class Events:
    def __init__(self, path: Path) -> None:
        self.path = path

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "at": time.monotonic(), **fields})
        with self.path.open("a") as f:
            f.write(line + "\n")


def plain_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
    )


def wait_for_go(go: Path, on_tick: Any = None) -> None:
    deadline = time.monotonic() + GO_DEADLINE
    while not go.exists():
        if on_tick is not None:
            on_tick()
        if time.monotonic() > deadline:
            raise SystemExit(f"no go file {go} within {GO_DEADLINE:.0f}s")
        time.sleep(0.01)


def run_jobfence(args: argparse.Namespace, events: Events) -> None:
    backend = RedisBackend.from_url(args.url, socket_timeout=0.5)
    keeper = LeaseKeeper()
    executor = Executor(backend, keeper, backoff=Backoff())
    guard = RedisFenceGuard(plain_client(args.url))
    spec = JobSpec(
        name="row_b", key=args.key, fingerprint="fp", ttl=args.ttl, result_ttl=600,
        task_id="task-in-namespace",
    )  # fmt: skip

    def body(job: JobContext) -> str:
        lease = job.lease
        events.emit("holding", fence=job.fence, deadline=lease.deadline - lease.drift)
        lease.on_lost(lambda _lease, cause: events.emit("marked", cause=type(cause).__name__))
        reported = False

        def watch() -> None:
            # From `deadline` on, lease.check() raises: the lease no longer counts.
            nonlocal reported
            if not reported and lease.lost:
                reported = True
                events.emit("lost", fence=job.fence, deadline=lease.deadline - lease.drift)

        wait_for_go(Path(args.go), watch)
        watch()
        # A body that ignores job.check() and writes anyway: the guard must refuse it.
        try:
            guard.write(RESOURCE, job.fence, [("RPUSH", LEDGER, f"namespace:{job.fence}")])
        except StaleFence as exc:
            events.emit("refused", fence=job.fence, last=exc.last)
            raise
        events.emit("wrote", fence=job.fence)
        return "charged"

    try:
        outcome = executor.run(spec, body)
        events.emit("outcome", status=outcome.status)
    except Exception as exc:
        events.emit("outcome", status=f"error:{type(exc).__name__}")
    finally:
        keeper.stop()
        backend.close()


def run_naive(args: argparse.Namespace, events: Events) -> None:
    client = plain_client(args.url)
    token = secrets.token_hex(8)
    if not client.set(args.key, token, nx=True, px=int(args.ttl * 1000)):
        events.emit("outcome", status="busy")
        return
    events.emit("holding")
    wait_for_go(Path(args.go))
    client.rpush(LEDGER, "namespace")  # no fence: nothing can refuse it
    events.emit("wrote")
    events.emit("outcome", status="ran")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["jobfence", "naive"], required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--go", required=True)
    args = parser.parse_args()
    events = Events(Path(args.events))
    if args.mode == "jobfence":
        run_jobfence(args, events)
    else:
        run_naive(args, events)


if __name__ == "__main__":
    main()
