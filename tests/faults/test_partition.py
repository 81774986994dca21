"""Row b: a network partition between one worker and the lock server (namespaces + nftables).

Fault: a worker process runs inside its own network namespace, joined to the host by a
veth pair; the private redis-server (lock server and ledger) listens on the host's end.
While the worker holds a job's lock, nftables drops every packet on that link. The lease
runs out on the server, a process outside takes the job with a newer fence and writes;
then the partition heals and the cut-off worker, which never stopped running, writes too.

Control: a naive worker (SET NX lock with a TTL, no keeper, no fence) writes after the
heal: two ledger entries for one job, the double effect.

jobfence: the cut-off worker's lease is marked lost (by the keeper, at its deadline)
before the server let anyone else in; its write after the heal carries the old fence and
the Redis fence guard refuses it (StaleFence); the job completes once, under the newer
fence, with one ledger entry and one DONE record.

Needs root, `ip` and `nft`: skipped with the reason otherwise (CI runs as root).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobfence.locks.acquire import Backoff
from jobfence.locks.backends.redis import RedisBackend
from jobfence.locks.guards import RedisFenceGuard
from jobfence.locks.keeper import LeaseKeeper
from jobfence.tasks.context import JobContext
from jobfence.tasks.executor import Executor, JobSpec
from tests.faults.netns import NetNamespace
from tests.faults.partition_worker import LEDGER, RESOURCE
from tests.servers import ProcessGroup, RedisServer, wait_for

pytestmark = pytest.mark.fault

TTL = 2.0
SLACK = 15.0  # headroom for a loaded box: interpreter start-up inside the namespace, ...
REPO = Path(__file__).resolve().parents[2]
KEY = "job:row-b"


class Worker:
    """The partition worker process and its event file."""

    def __init__(
        self, group: ProcessGroup, ns: NetNamespace, server: RedisServer, tmp: Path, mode: str
    ) -> None:
        self.events_path = tmp / f"{mode}-events.jsonl"
        self.go = tmp / f"{mode}-go"
        self.events_path.touch()
        self.group = group
        self.proc: subprocess.Popen[bytes] = group.spawn(
            [
                *ns.exec_prefix, sys.executable, "-m", "tests.faults.partition_worker",
                "--mode", mode, "--url", server.url_for(ns.host_address),
                "--key", KEY, "--ttl", str(TTL),
                "--events", str(self.events_path), "--go", str(self.go),
            ],
            cwd=REPO,
            name=f"partition-worker-{mode}",
        )  # fmt: skip

    def events(self) -> list[dict[str, Any]]:
        lines = self.events_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def event(self, name: str, timeout: float = SLACK) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            found = [e for e in self.events() if e["event"] == name]
            if not found and self.proc.poll() is not None:
                raise AssertionError(f"worker exited without {name!r}:\n{self.log()}")
            return found[0] if found else None

        found = wait_for(find, timeout, message=lambda: f"no {name!r} event:\n{self.log()}")
        assert found is not None
        return found

    def log(self) -> str:
        return f"events: {self.events()}\n{self.group.log_of(self.proc)}"


@pytest.fixture
def lock_server(net_namespace: NetNamespace) -> Iterator[RedisServer]:
    with RedisServer(bind=(net_namespace.host_address, "127.0.0.1")) as server:
        yield server


def test_control_naive_worker_writes_after_the_partition_heals(
    net_namespace: NetNamespace,
    lock_server: RedisServer,
    process_group: ProcessGroup,
    tmp_path: Path,
) -> None:
    ns, store = net_namespace, lock_server.client(decode_responses=True)
    worker = Worker(process_group, ns, lock_server, tmp_path, "naive")
    worker.event("holding")
    ns.cut()
    # Outside: the same naive job takes the lock once its TTL has run out, and writes.
    wait_for(
        lambda: store.set(KEY, "outside", nx=True, px=int(TTL * 1000)),
        TTL + SLACK,
        interval=0.05,
        message="the naive lock never expired",
    )
    store.rpush(LEDGER, "outside")
    ns.heal()
    worker.go.touch()
    worker.event("wrote")
    assert sorted(store.lrange(LEDGER, 0, -1)) == ["namespace", "outside"]  # twice


def test_partitioned_worker_loses_its_lease_and_its_late_write_is_refused(
    net_namespace: NetNamespace,
    lock_server: RedisServer,
    process_group: ProcessGroup,
    tmp_path: Path,
) -> None:
    ns, store = net_namespace, lock_server.client(decode_responses=True)
    worker = Worker(process_group, ns, lock_server, tmp_path, "jobfence")
    holding = worker.event("holding")
    ns.cut()

    backend = RedisBackend.from_url(lock_server.url)
    keeper = LeaseKeeper()
    guard = RedisFenceGuard(lock_server.client(decode_responses=True))
    granted: list[tuple[int, float]] = []

    def body(job: JobContext) -> str:
        granted.append((job.fence, time.monotonic()))
        guard.write(RESOURCE, job.fence, [("RPUSH", LEDGER, f"outside:{job.fence}")])
        return "charged"

    try:
        # Outside: a redelivery of the same job waits for the lock and runs it.
        spec = JobSpec(
            name="row_b", key=KEY, fingerprint="fp", ttl=TTL, result_ttl=600,
            task_id="task-outside", on_conflict="wait", wait_timeout=TTL + SLACK,
        )  # fmt: skip
        outcome = Executor(backend, keeper, backoff=Backoff()).run(spec, body)
        assert outcome.status == "ran"
        (fence, granted_at) = granted[0]
        assert fence > holding["fence"]

        # The cut-off worker's lease stopped counting before anyone else got the lock (the
        # deadline is on the monotonic clock all processes here share), and its keeper
        # marked it lost, which fails its lease.check() and fires its loss callbacks.
        lost = worker.event("lost")
        assert lost["deadline"] <= granted_at
        marked = worker.event("marked")
        assert marked["at"] <= lost["deadline"] + SLACK

        ns.heal()
        worker.go.touch()
        refused = worker.event("refused")
        assert refused["fence"] == holding["fence"] and refused["last"] == fence
        final = worker.event("outcome")
        assert final["status"] != "ran", worker.log()
        assert not [e for e in worker.events() if e["event"] == "wrote"]

        # The job completed once: one ledger entry, under the newer fence, and one DONE.
        assert store.lrange(LEDGER, 0, -1) == [f"outside:{fence}"]
        record = backend.job_record(KEY)
        assert record is not None and record.state == "DONE" and record.fence == fence
    finally:
        keeper.stop()
        backend.close()
