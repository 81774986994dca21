"""`jobfence locks why TASK_ID` on a real worker: a skipped duplicate, a superseded copy and a
refused stale write, each explained from the decision log; the log lines hold no argument."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from jobfence.config import Settings
from jobfence.locks import RedisFenceGuard
from jobfence.tasks import current_lease, install, runtime_for, singleton_task
from jobfence.worker.cli import main
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration]

DEADLINE = 20.0
#: Every test's job argument starts with this: no log line or CLI answer may show it.
ARGUMENT = "card-4111-1111-SECRET"


@dataclass
class World:
    app: Celery
    lock_url: str
    flags: redis.Redis  # the bodies' gates and "started" marks (db 3)
    records: list[logging.LogRecord]

    def task(self, name: str) -> Any:
        return self.app.tasks[f"why.{name}"]

    def started(self, job: str) -> None:
        wait_for(lambda: self.flags.exists(f"started:{job}"), DEADLINE, 0.01, f"{job} started")

    def open(self, job: str) -> None:
        self.flags.set(f"open:{job}", 1)

    def why(self, subject: str, capsys: pytest.CaptureFixture[str]) -> str:
        recorder = runtime_for(self.app).executor.recorder
        assert recorder is not None
        recorder.flush()  # what the worker decided, stored now (its writer would within 0.2 s)
        capsys.readouterr()
        code = main(["locks", "--lock-url", self.lock_url, "why", subject])
        out = capsys.readouterr().out
        assert code == 0, out
        return out


def _gate(flags: redis.Redis, job: str) -> None:
    flags.set(f"started:{job}", 1)
    deadline = time.monotonic() + DEADLINE
    while not flags.exists(f"open:{job}") and time.monotonic() < deadline:
        time.sleep(0.01)


def _build(broker: RedisServer, lock_url: str) -> Celery:
    app = Celery(f"why-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(
        broker_url=broker.db_url(1), result_backend=broker.db_url(2), task_serializer="json",
        result_serializer="json", accept_content=["json"], task_acks_late=True,
        broker_transport_options={"visibility_timeout": 60},
    )  # fmt: skip
    install(app, Settings(lock_url=lock_url, key_secret="k" * 40, visibility_timeout=60))
    flags = redis.Redis.from_url(broker.db_url(3))

    @singleton_task(app=app, name="why.gated", key=["job"], shared=False)
    def gated(job: str) -> str:
        _gate(flags, job)
        return "ran"

    @singleton_task(app=app, name="why.replace", key=["job"], shared=False,
                    dedupe_on_publish=True, on_duplicate_publish="replace")  # fmt: skip
    def replace(job: str, version: str) -> str:
        return version

    @singleton_task(app=app, name="why.fenced", key=["job"], shared=False)
    def fenced(job: str) -> str:
        _gate(flags, job)
        guard = RedisFenceGuard(redis.Redis.from_url(lock_url))
        guard.write(f"balance:{{{uuid.uuid5(uuid.NAMESPACE_OID, job).hex}}}",
                    current_lease().fence, [("SET", "x", "1")])  # fmt: skip
        return "wrote"

    @singleton_task(app=app, name="why.charge", key=["job"], shared=False)
    def charge(job: str, amount: int) -> int:
        return amount

    del gated, replace, fenced, charge
    return app


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """A private redis-server: locks (db 0), broker (1), results (2), flags (3); a real
    consumer (Celery's threads pool in this process)."""
    keep = _Keep()
    decisions = logging.getLogger("jobfence.decisions")
    decisions.addHandler(keep)
    old_level = decisions.level
    decisions.setLevel(logging.DEBUG)
    with RedisServer() as server:
        lock_url = server.db_url(0)
        app = _build(server, lock_url)
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False,
                          loglevel="WARNING", shutdown_timeout=10.0):  # fmt: skip
            yield World(app, lock_url, redis.Redis.from_url(server.db_url(3)), keep.records)
        app.close()
    decisions.removeHandler(keep)
    decisions.setLevel(old_level)


def job() -> str:
    return f"{ARGUMENT}-{uuid.uuid4().hex[:8]}"


def test_why_explains_a_skipped_duplicate(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    j, task = job(), world.task("gated")
    first = task.delay(j)
    world.started(j)
    copy = task.delay(j)
    with pytest.raises(Exception, match="a copy of this job is running"):
        copy.get(timeout=DEADLINE)
    world.open(j)
    assert first.get(timeout=DEADLINE) == "ran"
    out = world.why(copy.id, capsys)
    fence = _fence_of(world, first.id, capsys)
    assert f"skipped: a duplicate of task {first.id} (fence {fence}) which held the key" in out
    assert ARGUMENT not in out
    # The holder's own story: granted, then done, under that fence.
    mine = world.why(first.id, capsys)
    assert f"granted the lease (fence {fence})" in mine and "done:" in mine


def test_why_says_which_arguments_met_which_in_an_idempotency_conflict(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 31, item 8: a key reused with other arguments failed with IdempotencyConflict
    and left no decision, so `locks why` could not say what met what. Now: a few hex
    digits of each keyed fingerprint, never the arguments."""
    j, task = job(), world.task("charge")
    assert task.delay(j, 1250).get(timeout=DEADLINE) == 1250
    other = task.delay(j, 9999)
    with pytest.raises(Exception, match="reused with different arguments"):
        other.get(timeout=DEADLINE)
    out = world.why(other.id, capsys)
    assert "refused (IdempotencyConflict): the key (fence " in out, out
    assert re.search(r"this delivery's arguments [0-9a-f]{8}, the key's [0-9a-f]{8}", out), out
    mine, theirs = re.findall(r"arguments ([0-9a-f]{8}), the key's ([0-9a-f]{8})", out)[0]
    assert mine != theirs
    assert ARGUMENT not in out and "9999" not in out and "1250" not in out


def test_why_explains_a_superseded_copy(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    j, task = job(), world.task("replace")
    old = task.apply_async((j, "v1"), countdown=1.0)  # held by the worker until then
    new = task.delay(j, "v2")
    assert new.get(timeout=DEADLINE) == "v2"
    with pytest.raises(Exception, match="a newer copy took this job over"):
        old.get(timeout=DEADLINE)
    out = world.why(old.id, capsys)
    assert f"superseded: a newer publish (task {new.id}) replaced it before it started" in out
    assert ARGUMENT not in out


def test_why_explains_a_refused_stale_write(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    j, task = job(), world.task("fenced")
    result = task.delay(j)
    world.started(j)
    # A newer holder wrote first: the resource's floor is above this job's fence.
    guard = RedisFenceGuard(redis.Redis.from_url(world.lock_url))
    resource = f"balance:{{{uuid.uuid5(uuid.NAMESPACE_OID, j).hex}}}"
    newer = guard.advance(resource, 2**62)
    world.open(j)
    with pytest.raises(Exception, match="a newer copy took this job over"):
        result.get(timeout=DEADLINE)
    out = world.why(result.id, capsys)
    fence = _fence_of(world, result.id, capsys)
    assert f"stale write refused: fence {fence} < {newer}" in out
    assert ARGUMENT not in out


def test_decision_log_lines_hold_no_argument(world: World) -> None:
    """Run last in the module: every decision line written so far (all three stories)."""
    seen = {getattr(r, "decision", None) for r in world.records}
    assert {"conflict", "superseded", "stale", "started", "done"} <= seen, seen
    for record in world.records:
        fields = " ".join(str(v) for v in vars(record).values())
        assert ARGUMENT not in record.getMessage() and ARGUMENT not in fields
        assert record.job_key.startswith(record.task_name + ":")  # type: ignore[attr-defined]


def _fence_of(world: World, task_id: str, capsys: pytest.CaptureFixture[str]) -> int:
    """The fence `task_id` was granted, from `locks why --json`."""
    capsys.readouterr()
    assert main(["locks", "--lock-url", world.lock_url, "why", task_id, "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    fences = [d["fence"] for d in data if d["task_id"] == task_id and d["fence"] is not None]
    assert fences, data
    return int(fences[0])
