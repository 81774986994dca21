"""on_conflict="supersede" (issue 34, item 3): the newest publish takes the key from the
running copy with a higher fence; the running copy's lease ends, its fenced writes are
refused, it ends JobSuperseded without a DONE record, and the new copy runs. On a real worker
(Celery's threads pool), a private redis-server broker, lock server and effects store."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from jobfence.config import Settings
from jobfence.locks import Backoff, Lease, LeaseKeeper, MemoryBackend
from jobfence.locks.backend import default_meta
from jobfence.locks.errors import LeaseLost, StaleFence
from jobfence.locks.guards.redis import RedisFenceGuard
from jobfence.tasks import (
    Executor,
    JobSuperseded,
    TaskDefinitionError,
    current_job,
    install,
    runtime_for,
    singleton_task,
)
from jobfence.tasks.decisions import describe
from jobfence.tasks.options import django_options
from tests.servers import RedisServer, wait_for
from tests.tasks.conftest import spec_for


@pytest.fixture
def app(fresh_redis: RedisServer) -> Iterator[Celery]:
    app = Celery("supersede-test", set_as_current=False)
    app.conf.update(broker_url=fresh_redis.db_url(0), result_backend=fresh_redis.db_url(1),
                    task_serializer="json", accept_content=["json"],
                    result_accept_content=["json"])  # fmt: skip
    settings = Settings(lock_url=fresh_redis.db_url(2), key_prefix="ss",
                        key_secret="supersede-test-secret-not-for-production")  # fmt: skip
    runtime = install(app, settings)
    yield app
    runtime.close()


@pytest.fixture
def store(fresh_redis: RedisServer) -> Iterator[redis.Redis]:
    """The effects' own Redis (db 3): the fenced document and the unfenced control."""
    client = fresh_redis.client(db=3, decode_responses=True)
    yield client
    client.close()


def _worker(app: Celery) -> Any:
    return start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                        loglevel="WARNING")  # fmt: skip


def test_the_newest_publish_takes_the_key_and_the_old_runs_late_write_is_refused(
    app: Celery, store: redis.Redis
) -> None:
    guard = RedisFenceGuard(store)
    started: dict[str, int] = {}
    newest_wrote = threading.Event()
    seen: dict[str, Any] = {}

    @singleton_task(app=app, name=f"ss.render.{uuid.uuid4().hex[:8]}", key=["doc"],
                    on_conflict="supersede", ttl=3)  # fmt: skip
    def render(doc: str, version: str) -> str:
        fence = current_job().fence
        started[version] = fence
        if version == "old":
            # Still running when the newest publish arrives; it writes after the new run.
            assert newest_wrote.wait(15), "the newest run never wrote"
            store.set(f"plain:{doc}", version)  # the control: an unfenced write lands
            try:
                guard.write(f"doc:{doc}", fence, [("SET", f"doc:{doc}", version)])
            except StaleFence as exc:
                seen["refused"] = exc
                raise
            seen["landed"] = True
            return version
        guard.write(f"doc:{doc}", fence, [("SET", f"doc:{doc}", version)])
        store.set(f"plain:{doc}", version)
        newest_wrote.set()
        return version

    with _worker(app):
        old = render.delay("d1", "old")
        wait_for(lambda: "old" in started, 10.0)
        new = render.delay("d1", "new")
        assert new.get(timeout=15) == "new"
        with pytest.raises(JobSuperseded):
            old.get(timeout=15)
    assert started["new"] > started["old"], "the new run's fence is not higher"
    assert "refused" in seen and "landed" not in seen, "the old run's fenced write landed"
    assert store.get("doc:d1") == "new"
    # The control: the same late write, unfenced, overwrote the newest run's.
    assert store.get("plain:d1") == "old"


def test_the_old_run_sees_its_lease_lost_and_ends_without_a_record(app: Celery) -> None:
    started: list[str] = []
    lost = threading.Event()

    @singleton_task(app=app, name=f"ss.sync.{uuid.uuid4().hex[:8]}", key=["doc"],
                    on_conflict="supersede", ttl=1.5)  # fmt: skip
    def sync(doc: str, version: str) -> str:
        started.append(version)
        if version == "old":
            job = current_job()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:  # its keeper's next extension tells it
                try:
                    job.check()
                except LeaseLost:
                    lost.set()
                    raise
                time.sleep(0.02)
            raise AssertionError("the old run never saw its lease lost")
        return version

    with _worker(app):
        old = sync.delay("d2", "old")
        wait_for(lambda: started == ["old"], 10.0)
        new = sync.delay("d2", "new")
        assert new.get(timeout=15) == "new"
        with pytest.raises(JobSuperseded) as stop:
            old.get(timeout=15)
        assert stop.value.task_id == new.id  # the run that stands for it
        recorder = runtime_for(app).executor.recorder
        assert recorder is not None and recorder.store is not None
        recorder.flush()
        took = [d for d in recorder.store.for_task(new.id) if d.event == "evicted"]
        gave = {d.event for d in recorder.store.for_task(old.id)}
    assert lost.is_set()
    assert started == ["old", "new"]
    # The decision log (`jobfence locks why`) says who took the key from whom.
    assert len(took) == 1 and took[0].holder == old.id, took
    assert describe(took[0]).startswith(f"took the key from task {old.id} (fence ")
    assert "superseded" in gave, gave


def test_the_old_run_hears_of_the_eviction_at_once_not_at_its_next_extension(
    app: Celery,
) -> None:
    """On Redis the eviction is announced, and the old run's keeper hears it: with a TTL of
    30 s (the next extension 10 s away) the old run's `on_lost` hook fires within a few
    seconds of the newer run's grant. (The control, a backend that announces nothing, is
    `tests/test_keeper.py`'s unwatched lease.)"""
    started: dict[str, float] = {}
    lost_at: list[float] = []
    lost = threading.Event()

    @singleton_task(app=app, name=f"ss.prompt.{uuid.uuid4().hex[:8]}", key=["doc"],
                    on_conflict="supersede", ttl=30)  # fmt: skip
    def export(doc: str, version: str) -> str:
        started[version] = time.monotonic()
        if version == "old":
            job = current_job()
            job.lease.on_lost(lambda _lease, _cause: (lost_at.append(time.monotonic()),
                                                      lost.set()))  # fmt: skip
            assert lost.wait(25), "the old run never heard it was evicted"
            job.check()  # raises LeaseLost: the run ends superseded
        return version

    with _worker(app):
        old = export.delay("d3", "old")
        wait_for(lambda: "old" in started, 10.0)
        new = export.delay("d3", "new")
        assert new.get(timeout=15) == "new"
        with pytest.raises(JobSuperseded):
            old.get(timeout=30)
    heard_after = lost_at[0] - started["new"]
    assert heard_after < 5.0, f"heard {heard_after:.1f}s after the newer run started"


def test_control_with_wait_the_newest_publish_waits_for_the_old_run(app: Celery) -> None:
    """The same two publishes under on_conflict="wait": the old run is never stopped and
    finishes first; the newer one runs only after it (what supersede changes)."""
    order: list[str] = []
    release = threading.Event()

    @singleton_task(app=app, name=f"ss.wait.{uuid.uuid4().hex[:8]}", key=["doc"],
                    on_conflict="wait", lock_until="start", dedupe_on_publish=True,
                    wait_timeout=15)  # fmt: skip
    def sync(doc: str, version: str) -> str:
        order.append(version)
        if version == "old":
            assert release.wait(15)
        order.append(version + " done")
        return version

    with _worker(app):
        old = sync.delay("d3", "old")
        wait_for(lambda: order == ["old"], 10.0)
        new = sync.delay("d3", "new")
        time.sleep(0.5)  # the control shows a wait: the new run has not started meanwhile
        assert order == ["old"]
        release.set()
        assert (old.get(timeout=15), new.get(timeout=15)) == ("old", "new")
    assert order == ["old", "old done", "new", "new done"]


def test_a_burst_of_publishes_runs_the_newest_and_supersedes_the_rest(app: Celery) -> None:
    runs: list[str] = []

    @singleton_task(app=app, name=f"ss.burst.{uuid.uuid4().hex[:8]}", key=["doc"],
                    on_conflict="supersede", ttl=2)  # fmt: skip
    def sync(doc: str, version: str) -> str:
        runs.append(version)
        job = current_job()
        for _ in range(20):  # a body that looks at its lease as it works
            job.check()
            time.sleep(0.02)
        return version

    with _worker(app):
        copies = []
        for i in range(6):
            copies.append(sync.delay("d4", f"v{i}"))
            time.sleep(0.1)
        assert copies[-1].get(timeout=20) == "v5"
        wait_for(lambda: all(c.ready() for c in copies), 20.0)
    for c in copies[:-1]:
        if c.successful():  # it finished before a newer publish met it
            continue
        with pytest.raises(JobSuperseded):
            c.get(timeout=1)
    assert runs[-1] == "v5" and runs.count("v5") == 1


def _body(doc: str) -> str:
    return doc


@pytest.mark.parametrize("policy", ["supersede", "debounce"])
@pytest.mark.parametrize("order", ["known", "unknown"])
def test_an_outbox_row_sent_late_gives_way_to_a_newer_publish(
    app: Celery, tmp_path: Any, policy: str, order: str
) -> None:
    """A web process committed its row (version 1) and died before the publish; a newer
    publish (version 2) went out; the relay sends the row later. The row's copy must not
    take the key from the newer publish: version 2 runs, the row's copy ends JobSuperseded
    naming it. The control, in the same run: a newer publish under the caller's own task id
    (when it was made is unknown, as it was for every publish before task ids told it): the
    late row replaces its claim, and the older version runs while the newer one is
    superseded."""
    from jobfence.tasks import make_engine
    from jobfence.tasks.effects import outbox
    from jobfence.tasks.outbox import SqlOutbox, entry_for
    from jobfence.tasks.publish import ordered_id
    from jobfence.worker.outbox_relay import OutboxRelay

    ran: list[str] = []
    options: dict[str, Any] = ({"on_conflict": "supersede"} if policy == "supersede"
                               else {"debounce": 0.3})  # fmt: skip

    @singleton_task(app=app, name=f"ss.late.{uuid.uuid4().hex[:8]}", key=["doc"], **options)
    def render(doc: str, version: str) -> str:
        ran.append(version)
        return version

    engine = make_engine(f"sqlite:///{tmp_path / 'outbox.sqlite'}")
    with engine.begin() as conn:
        outbox.create(conn, checkfirst=True)
    store = SqlOutbox(engine)
    entry = entry_for(render, ("d1", "v1"), {}, {}, ordered_id())
    # Written (and committed) a second ago; its process died before the publish.
    entry = dataclasses.replace(entry, created_at=entry.created_at - 1.0)
    with engine.begin() as conn:
        store.write(conn, entry)
    own = None if order == "known" else f"caller-own-{uuid.uuid4().hex[:8]}"
    newer = render.apply_async(("d1", "v2"), task_id=own)
    relay = OutboxRelay(app, runtime_for(app), store, grace=0.0, poll=0.05, retention=3600.0)
    assert relay.relay_once() == 1
    late = app.AsyncResult(entry.task_id)
    stands, gives_way = (newer, late) if order == "known" else (late, newer)
    with _worker(app):
        assert stands.get(timeout=15) == ("v2" if order == "known" else "v1")
        with pytest.raises(JobSuperseded) as stop:
            gives_way.get(timeout=15)
    assert stop.value.task_id == stands.id
    assert ran == (["v2"] if order == "known" else ["v1"])
    engine.dispose()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"unique_for": 10}, "unique_for"),
        ({"dedupe_on_publish": True, "on_duplicate_publish": "raise"}, "on_duplicate_publish"),
        ({"debounce": 5}, "on_conflict"),
    ],
)
def test_options_against_supersede_are_refused_naming_them(
    app: Celery, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(TaskDefinitionError, match=named):
        singleton_task(app=app, name=f"ss.bad.{uuid.uuid4().hex[:8]}", key=["doc"],
                       on_conflict="supersede", **options)(_body)  # fmt: skip


def test_supersede_sets_what_it_needs(app: Celery) -> None:
    task = singleton_task(app=app, name=f"ss.set.{uuid.uuid4().hex[:8]}", key=["doc"],
                          on_conflict="supersede")(_body)  # fmt: skip
    o = task.jobfence_options
    assert (o.dedupe_on_publish, o.on_duplicate_publish, o.lock_until, o.replaces_started) == (
        True, "replace", "start", True
    )  # fmt: skip


def test_a_django_task_refuses_supersede_with_the_reason() -> None:
    with pytest.raises(TaskDefinitionError, match="publish claim"):
        django_options({"key": ["doc"], "on_conflict": "supersede"})


# -- the flow on the in-memory backend: who takes the key, who gives way --------------------

SUPERSEDE = {"on_conflict": "supersede", "lock_until": "start", "supersede": True,
             "publish_claim": True, "replaces_started": True}  # fmt: skip


@pytest.fixture
def run_on() -> Iterator[tuple[Executor, MemoryBackend]]:
    memory = MemoryBackend()
    keeper = LeaseKeeper()
    yield Executor(memory, keeper, backoff=Backoff(0.005, 0.05)), memory
    keeper.stop()


def test_the_copy_the_claim_names_takes_the_key_with_a_higher_fence(
    run_on: tuple[Executor, MemoryBackend],
) -> None:
    executor, memory = run_on
    key = uuid.uuid4().hex
    old = memory.begin(key, 30.0, meta=default_meta("A", "tests.job"))
    assert isinstance(old, Lease)
    assert memory.swap_publish(key, "x", "B", 60) is None  # B's publish is the newest
    out = executor.run(spec_for(key, task_id="B", **SUPERSEDE), lambda ctx: ctx.fence)
    assert out.status == "ran" and out.value > old.fence
    with pytest.raises(LeaseLost):
        old.extend()  # the old grant is gone: its keeper's next extension finds it


def test_an_older_copy_meeting_the_newest_run_gives_way_unrun(
    run_on: tuple[Executor, MemoryBackend],
) -> None:
    executor, memory = run_on
    key = uuid.uuid4().hex
    newest = memory.begin(key, 30.0, meta=default_meta("B", "tests.job"))
    assert isinstance(newest, Lease)
    assert memory.swap_publish(key, "x", "!B", 60) is None  # B's run started
    calls: list[int] = []
    out = executor.run(spec_for(key, task_id="A", **SUPERSEDE), lambda ctx: calls.append(1))
    assert (out.status, out.holder, calls) == ("superseded", "B", [])
    newest.extend()  # still B's


def test_with_no_claim_to_tell_the_order_a_copy_queues_behind_the_run(
    run_on: tuple[Executor, MemoryBackend],
) -> None:
    executor, memory = run_on
    key = uuid.uuid4().hex
    held = memory.begin(key, 30.0, meta=default_meta("A", "tests.job"))
    assert isinstance(held, Lease)  # no claim: the lock server lost it, say
    out = executor.run(spec_for(key, task_id="B", queues=True, **SUPERSEDE), lambda ctx: 1)
    assert out.status == "requeue"
    held.extend()  # never taken from a holder it cannot prove older


def test_in_a_rotation_the_newest_takes_the_key_from_a_run_under_the_other_secret(
    run_on: tuple[Executor, MemoryBackend],
) -> None:
    """A run under the other secret holds the job's key there: the newest publish takes it
    whichever key ranks first (the claim says which copy is newest, not the keys)."""
    executor, memory = run_on
    for mine, theirs in (("a" + uuid.uuid4().hex, "b" + uuid.uuid4().hex),
                         ("b" + uuid.uuid4().hex, "a" + uuid.uuid4().hex)):  # fmt: skip
        old = memory.begin(theirs, 30.0, meta=default_meta("A", "tests.job"))
        assert isinstance(old, Lease)
        for key in (mine, theirs):  # the publish claimed under both secrets' keys
            assert memory.swap_publish(key, "x", "B", 60) is None
        spec = spec_for(mine, task_id="B", previous=((theirs, "fp-" + mine),), **SUPERSEDE)
        out = executor.run(spec, lambda ctx: ctx.fence)
        assert out.status == "ran", (mine < theirs, out)
        with pytest.raises(LeaseLost):
            old.extend()
