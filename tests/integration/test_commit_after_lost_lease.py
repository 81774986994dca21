"""A body that returns after its lease was force-released (`jobfence locks release KEY --force`)
on a real worker and Redis: its commit is refused, so the job is never reported done but
delivered again; the re-run is answered by the effect's own DONE row (`SqlEffects`), and
`jobfence locks why` (text and --json) and the metrics say what happened."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from jobfence.config import Settings
from jobfence.tasks import current_job, install, runtime_for, singleton_task
from jobfence.tasks.effects import SqlEffects, make_engine
from jobfence.worker.cli import main
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.fault]

DEADLINE = 30.0
ledger = Table("bookings", MetaData(), Column("id", Integer, primary_key=True),
               Column("job", String(64), nullable=False))  # fmt: skip


@dataclass
class World:
    app: Celery
    lock_url: str
    flags: redis.Redis  # the bodies' counts, keys and gates (db 3)
    effects: SqlEffects
    states: dict[str, list[str]] = field(default_factory=dict)  # task id -> Celery states

    def task(self, name: str) -> Any:
        return self.app.tasks[f"lost.{name}"]

    def states_of(self, task_id: str, n: int) -> list[str]:
        """The Celery states `task_id`'s deliveries ended in, once there are `n` (sorted: a
        redelivery may end before the delivery that published it reports)."""
        wait_for(lambda: len(self.states.get(task_id, [])) >= n, DEADLINE, 0.01,
                 f"{n} deliveries of {task_id} ended")  # fmt: skip
        return sorted(self.states[task_id])

    def count(self, what: str, job: str) -> int:
        return int(self.flags.get(f"{what}:{job}") or 0)

    def force_release_mid_body(self, job: str) -> None:
        """Once the body is in, the documented stuck-lock step removes its lock; then the
        body goes on and returns."""
        wait_for(lambda: self.count("bodies", job) >= 1, DEADLINE, 0.01, f"{job} started")
        key = self.flags.get(f"key:{job}")
        assert key is not None
        assert main(["locks", "--lock-url", self.lock_url, "release", key.decode(), "--force"]) == 0
        self.flags.set(f"open:{job}", 1)

    def why(self, task_id: str, capsys: pytest.CaptureFixture[str]) -> tuple[str, list[Any]]:
        recorder = runtime_for(self.app).executor.recorder
        assert recorder is not None
        recorder.flush()
        capsys.readouterr()
        assert main(["locks", "--lock-url", self.lock_url, "why", task_id]) == 0
        text = capsys.readouterr().out
        assert main(["locks", "--lock-url", self.lock_url, "why", task_id, "--json"]) == 0
        return text, json.loads(capsys.readouterr().out)

    def executions(self, task: str, outcome: str) -> float:
        registry = runtime_for(self.app).metrics.registry
        labels = {"task": f"lost.{task}", "outcome": outcome}
        return registry.get_sample_value("jobfence_executions_total", labels) or 0.0


def _build(server: RedisServer, lock_url: str, effects: SqlEffects) -> Celery:
    app = Celery(f"lost-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(
        broker_url=server.db_url(1), result_backend=server.db_url(2), task_serializer="json",
        result_serializer="json", accept_content=["json"], task_acks_late=True,
        broker_transport_options={"visibility_timeout": 60},
    )  # fmt: skip
    install(app, Settings(lock_url=lock_url, key_secret="k" * 40, visibility_timeout=60,
                          redelivery_delay=0.2))  # fmt: skip
    flags = redis.Redis.from_url(server.db_url(3))

    def enter(job: str) -> None:
        flags.incr(f"bodies:{job}")
        flags.set(f"key:{job}", current_job().key)
        deadline = time.monotonic() + DEADLINE
        while not flags.exists(f"open:{job}") and time.monotonic() < deadline:
            time.sleep(0.01)

    @singleton_task(app=app, name="lost.book", key=["job"], shared=False)
    def book(job: str) -> str:
        enter(job)
        with effects.transaction(current_job(), f"seat:{job}") as tx:
            if tx.done:
                return str(tx.result)
            tx.conn.execute(ledger.insert().values(job=job))
            tx.result = "booked"
        return "booked"

    @singleton_task(app=app, name="lost.plain", key=["job"], shared=False)
    def plain(job: str) -> str:  # neither fenced nor idempotent: the control
        enter(job)
        flags.incr(f"writes:{job}")
        return "wrote"

    del book, plain
    return app


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A private redis-server: locks (db 0), broker (1), results (2), flags (3); a SQLite
    ledger; a real consumer (Celery's threads pool in this process)."""
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.sqlite'}")
    ledger.metadata.create_all(engine)
    effects = SqlEffects(engine)
    effects.create_schema()
    with RedisServer() as server:
        lock_url = server.db_url(0)
        app = _build(server, lock_url, effects)
        w = World(app, lock_url, redis.Redis.from_url(server.db_url(3)), effects)

        def seen(task_id: str = "", state: str | None = None, **_: Any) -> None:
            w.states.setdefault(task_id, []).append(str(state))

        task_postrun.connect(seen, weak=False)
        try:
            with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                              loglevel="WARNING", shutdown_timeout=10.0):  # fmt: skip
                yield w
        finally:
            task_postrun.disconnect(seen)
            app.close()
            engine.dispose()


def job() -> str:
    return f"job-{uuid.uuid4().hex[:12]}"


def _bookings(world: World, j: str) -> int:
    with world.effects.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(ledger.c.job == j)).scalar_one())


def test_a_commit_refused_after_a_forced_release_is_delivered_again_not_done(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    j = job()
    result = world.task("book").delay(j)
    world.force_release_mid_body(j)
    assert result.get(timeout=DEADLINE) == "booked"
    # The first delivery was not acked SUCCESS: it was delivered again, and the re-run's
    # booking was answered by the effect's own DONE row.
    assert world.states_of(result.id, 2) == ["IGNORED", "SUCCESS"]
    assert world.count("bodies", j) == 2 and _bookings(world, j) == 1
    assert world.executions("book", "done") == 1  # the re-run's; the first lost its lease
    assert world.executions("book", "lease_lost") == 1

    text, data = world.why(result.id, capsys)
    events = [(d["event"], d["fence"]) for d in data if d["task_id"] == result.id]
    first = events[0][1]
    assert [e for e, _ in events] == ["started", "commit_refused", "redeliver", "started",
                                      "effect_replayed", "done"], data  # fmt: skip
    assert ("done", first) not in events and events[-1][1] > first
    assert f"lease lost (fence {first}) before its commit: the body ran to its end; DONE " \
           "record not stored" in text  # fmt: skip
    assert "redelivered: lease lost before commit; DONE record not stored" in text
    assert "its effects' own DONE rows answered it" in text
    (redelivered,) = [d for d in data if d["event"] == "redeliver"]
    assert redelivered["reason"] == "lease lost before commit; DONE record not stored"


def test_the_control_a_write_neither_fenced_nor_idempotent_runs_again(world: World) -> None:
    """The same fault, a plain write: the redelivery really runs the body again."""
    j = job()
    result = world.task("plain").delay(j)
    world.force_release_mid_body(j)
    assert result.get(timeout=DEADLINE) == "wrote"
    assert world.states_of(result.id, 2) == ["IGNORED", "SUCCESS"]
    assert world.count("writes", j) == 2


def test_the_control_without_the_forced_release_the_job_runs_once_and_is_done(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    j = job()
    world.flags.set(f"open:{j}", 1)
    result = world.task("book").delay(j)
    assert result.get(timeout=DEADLINE) == "booked"
    assert world.states_of(result.id, 1) == ["SUCCESS"]
    assert world.count("bodies", j) == 1 and _bookings(world, j) == 1
    _, data = world.why(result.id, capsys)
    assert [d["event"] for d in data if d["task_id"] == result.id] == ["done"]
