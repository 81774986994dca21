"""SqlEffects and make_engine on SQLite, PostgreSQL and MariaDB: fenced, exactly-once effects."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from jobfence.locks import Backoff, Lease, LeaseKeeper, RedisBackend
from jobfence.locks.errors import StaleFence
from jobfence.tasks import (
    Executor,
    IdempotencyConflict,
    JobContext,
    SqlEffects,
    current_job,
    make_engine,
)
from jobfence.tasks.effects import jobs as jobs_table
from tests.servers import wait_for
from tests.tasks.conftest import job_with_fence as job
from tests.tasks.conftest import spec_for, sql_effects, unique

test_metadata = sa.MetaData()
ledger = sa.Table(
    "tasks_test_ledger",
    test_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job", sa.String(255), nullable=False),
    sa.Column("amount", sa.Integer, nullable=False),
)
counters = sa.Table(
    "tasks_test_counters",
    test_metadata,
    sa.Column("name", sa.String(255), primary_key=True),
    sa.Column("n", sa.Integer, nullable=False),
)



def pay(
    effects: SqlEffects,
    ctx: JobContext,
    *resources: str,
    amount: int = 100,
    during: Callable[[], None] | None = None,
) -> tuple[bool, Any]:
    """The canonical effect: (was it already done, the result)."""
    with effects.transaction(ctx, *resources) as tx:
        if tx.done:
            return True, tx.result
        tx.conn.execute(ledger.insert().values(job=ctx.key, amount=amount))
        tx.result = {"paid": amount, "fence": ctx.fence}
        if during is not None:
            during()
    return False, tx.result


def effect_rows(effects: SqlEffects, key: str) -> int:
    with effects.engine.connect() as conn:
        count = conn.execute(
            sa.select(sa.func.count()).select_from(ledger).where(ledger.c.job == key)
        ).scalar_one()
    return int(count)


def last_fence(effects: SqlEffects, resource: str) -> int | None:
    with effects.engine.connect() as conn:
        return effects.guard.last(conn, resource)


@pytest.fixture
def effects(sql_url: str) -> Iterator[SqlEffects]:
    with sql_effects(sql_url, test_metadata) as fx:
        yield fx


# -- one transaction ---------------------------------------------------------------------


def test_effect_and_done_row_commit_together(effects: SqlEffects) -> None:
    key, resource = unique(), unique("account")
    done, result = pay(effects, job(key, 7), resource)
    assert (done, result) == (False, {"paid": 100, "fence": 7})
    assert effect_rows(effects, key) == 1
    record = effects.record(key)
    assert record is not None
    assert (record["state"], record["fingerprint"], record["fence"]) == ("DONE", "fp", 7)
    assert last_fence(effects, resource) == 7


def test_a_failure_in_the_block_rolls_back_effect_fence_and_done_row(
    effects: SqlEffects,
) -> None:
    key, resource = unique(), unique("account")

    def fail() -> None:
        raise RuntimeError("downstream refused")

    with pytest.raises(RuntimeError):
        pay(effects, job(key, 7), resource, during=fail)
    assert effect_rows(effects, key) == 0
    assert effects.record(key) is None
    assert last_fence(effects, resource) is None


def test_an_unstorable_result_rolls_back_the_effect(effects: SqlEffects) -> None:
    key = unique()
    with pytest.raises(TypeError), effects.transaction(job(key, 1), unique("r")) as tx:
        tx.conn.execute(ledger.insert().values(job=key, amount=1))
        tx.result = {"at": object()}
    assert effect_rows(effects, key) == 0 and effects.record(key) is None


def test_a_second_execution_finds_done_and_writes_nothing(effects: SqlEffects) -> None:
    key, resource = unique(), unique("account")
    pay(effects, job(key, 1), resource, amount=100)
    done, result = pay(effects, job(key, 2), resource, amount=999)
    assert (done, result) == (True, {"paid": 100, "fence": 1})
    assert effect_rows(effects, key) == 1
    record = effects.record(key)
    assert record is not None and record["fence"] == 1  # the original DONE row, unchanged


def test_a_stale_fence_rolls_back_every_resource(effects: SqlEffects) -> None:
    base = unique("acct")
    first, second = f"{base}:a", f"{base}:b"  # checked in this (sorted) order
    pay(effects, job(unique(), 5), first)
    pay(effects, job(unique(), 20), second)
    key = unique()
    ran: list[bool] = []
    with (
        pytest.raises(StaleFence) as info,
        effects.transaction(job(key, 10), second, first) as tx,
    ):
        ran.append(True)
        tx.conn.execute(ledger.insert().values(job=key, amount=1))
    assert (info.value.resource, info.value.fence, info.value.last) == (second, 10, 20)
    assert ran == []
    assert effect_rows(effects, key) == 0
    assert effects.record(key) is None
    assert last_fence(effects, first) == 5  # advanced to 10 inside, then rolled back
    assert last_fence(effects, second) == 20


def test_a_stale_holder_of_the_same_job_writes_nothing(effects: SqlEffects) -> None:
    key, resource = unique(), unique("account")
    pay(effects, job(key, 20), resource)
    with pytest.raises(StaleFence):
        pay(effects, job(key, 10), resource, amount=5)
    assert effect_rows(effects, key) == 1


def test_same_key_other_arguments_conflicts(effects: SqlEffects) -> None:
    key, resource = unique(), unique("account")
    pay(effects, job(key, 1, fingerprint="fp-a"), resource)
    with pytest.raises(IdempotencyConflict) as info:
        pay(effects, job(key, 2, fingerprint="fp-b"), resource, amount=5)
    assert info.value.key == key
    assert effect_rows(effects, key) == 1
    assert last_fence(effects, resource) == 1  # the conflicting transaction rolled back


# -- two executions of one job at once -----------------------------------------------------


def _lock_waiters(effects: SqlEffects) -> int | None:
    """Sessions waiting on a row lock in this database (None where we cannot tell)."""
    dialect = effects.engine.dialect.name
    if dialect == "postgresql":
        query = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    elif dialect in ("mysql", "mariadb"):
        # INNODB_TRX does not always list a transaction blocked in its first statement;
        # the process list shows it in the guard's statement, where A's row lock holds it.
        query = (
            "SELECT count(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE() "
            "AND ID <> CONNECTION_ID() AND COMMAND = 'Query' AND INFO LIKE :pattern"
        )
    else:
        return None
    with effects.engine.connect() as conn:
        params = {"pattern": "%jobfence_fences%"} if ":pattern" in query else {}
        return int(conn.execute(sa.text(query), params).scalar_one())


def test_two_holders_of_one_job_in_fence_order_make_one_effect(effects: SqlEffects) -> None:
    """The older holder is inside its transaction when the newer one starts: one effect."""
    key, resource = unique(), unique("account")
    older_inside, newer_starting, older_may_commit = (threading.Event() for _ in range(3))

    def older() -> tuple[bool, Any]:
        def hold_open() -> None:
            older_inside.set()
            assert older_may_commit.wait(20)

        return pay(effects, job(key, 1), resource, during=hold_open)

    def newer() -> tuple[bool, Any]:
        assert older_inside.wait(20)
        newer_starting.set()
        return pay(effects, job(key, 2), resource, amount=999)

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(older), pool.submit(newer)
        assert newer_starting.wait(20)
        if _lock_waiters(effects) is not None:  # server databases: the newer one is blocked
            wait_for(lambda: _lock_waiters(effects), 10, message="newer never blocked")
        older_may_commit.set()
        assert a.result(30) == (False, {"paid": 100, "fence": 1})
        assert b.result(30) == (True, {"paid": 100, "fence": 1})
    assert effect_rows(effects, key) == 1
    assert last_fence(effects, resource) == 2


def test_two_unfenced_executions_collide_on_the_done_row(effects: SqlEffects) -> None:
    """Without a resource both see 'not done' and write; the DONE row's key lets one win."""
    if effects.engine.dialect.name == "sqlite":
        pytest.skip("SQLite runs write transactions one at a time (BEGIN IMMEDIATE)")
    key = unique()
    a_wrote, b_wrote = threading.Event(), threading.Event()

    def first() -> tuple[bool, Any]:
        def wait_for_b() -> None:
            a_wrote.set()
            assert b_wrote.wait(20)

        return pay(effects, job(key, 1), during=wait_for_b)

    def second() -> tuple[bool, Any]:
        assert a_wrote.wait(20)
        return pay(effects, job(key, 2), during=b_wrote.set)

    outcomes: list[Any] = []
    with ThreadPoolExecutor(2) as pool:
        for fut in [pool.submit(first), pool.submit(second)]:
            try:
                outcomes.append(fut.result(30))
            except IntegrityError as exc:
                outcomes.append(exc)
    assert sum(isinstance(o, IntegrityError) for o in outcomes) == 1, outcomes
    assert effect_rows(effects, key) == 1  # the loser's effect rolled back with its DONE row
    assert effects.record(key) is not None


# -- with the executor ---------------------------------------------------------------------


def test_the_sql_record_survives_a_lost_redis_record(
    effects: SqlEffects, redis_backend: RedisBackend
) -> None:
    """Layer 3 holds when the lock server forgets the job: the ledger knows it is done."""
    keeper = LeaseKeeper()
    executor = Executor(redis_backend, keeper, backoff=Backoff(0.005, 0.05))
    key, resource = unique(), unique("account")
    bodies: list[int] = []

    def body(ctx: JobContext) -> Any:
        bodies.append(ctx.fence)
        assert current_job() is ctx
        return pay(effects, ctx, resource)[1]

    try:
        first = executor.run(spec_for(key), body)
        assert redis_backend.forget(key)  # Redis lost the DONE record
        second = executor.run(spec_for(key), body)
    finally:
        keeper.stop()
    assert len(bodies) == 2 and bodies[1] > bodies[0]
    assert first.value == second.value == {"paid": 100, "fence": bodies[0]}
    assert effect_rows(effects, key) == 1


def test_a_stolen_lease_cannot_repeat_or_overwrite_the_effect(
    effects: SqlEffects, redis_backend: RedisBackend, other_redis_backend: RedisBackend
) -> None:
    """The old holder resumes after a newer one took the job and wrote: StaleFence, no effect."""
    keeper = LeaseKeeper()
    executor = Executor(redis_backend, keeper, backoff=Backoff(0.005, 0.05))
    key, resource = unique(), unique("account")
    newer: list[JobContext] = []

    def frozen_then_resumes(ctx: JobContext) -> Any:
        # While this holder was "frozen", its lease was taken over and the job completed.
        assert redis_backend.force_release(key)
        got = other_redis_backend.begin(key, 30, record=True, fingerprint=ctx.fingerprint)
        assert isinstance(got, Lease) and got.fence > ctx.fence
        newer.append(JobContext(key=key, fingerprint=ctx.fingerprint, lease=got))
        assert pay(effects, newer[0], resource, amount=100) == (
            False,
            {"paid": 100, "fence": got.fence},
        )
        return pay(effects, ctx, resource, amount=100)[1]  # the stale holder's write

    try:
        out = executor.run(spec_for(key, task_id="old"), frozen_then_resumes)
    finally:
        keeper.stop()
    assert out.status == "superseded"
    assert effect_rows(effects, key) == 1
    record = effects.record(key)
    assert record is not None and record["fence"] == newer[0].fence
    assert redis_backend.job_record(key) is None  # no DONE from the stale holder either


# -- SQLite with several writer processes --------------------------------------------------


def sqlite_writer(url: str, worker: int, count: int, start: Any) -> None:
    """One process: `count` fenced, read-then-write increments of shared counters."""
    engine = make_engine(url)
    effects = SqlEffects(engine)
    assert start.wait(60)
    for i in range(1, count + 1):
        with effects.transaction(job(f"w{worker}-{i}", i), f"writer:{worker}") as tx:
            n = tx.conn.execute(
                sa.select(counters.c.n).where(counters.c.name == "effects")
            ).scalar_one()
            tx.conn.execute(counters.update().where(counters.c.name == "effects").values(n=n + 1))
            tx.result = n + 1
        with engine.begin() as conn:  # reads first: needs BEGIN IMMEDIATE not to deadlock
            n = conn.execute(sa.select(counters.c.n).where(counters.c.name == "plain")).scalar_one()
            conn.execute(counters.update().where(counters.c.name == "plain").values(n=n + 1))
    engine.dispose()


def test_sqlite_engine_survives_concurrent_writer_processes(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    effects = SqlEffects(engine)
    effects.create_schema()
    test_metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(counters.insert(), [{"name": "effects", "n": 0}, {"name": "plain", "n": 0}])
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar_one() == "wal"
    engine.dispose()  # no open SQLite handle crosses the fork
    workers, count = 4, 50
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [
        ctx.Process(target=sqlite_writer, args=(sqlite_url, w, count, start))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    start.set()
    for p in procs:
        p.join(max(1.0, 60 - (time.monotonic() - t0)))
    try:
        assert [p.exitcode for p in procs] == [0] * workers
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    with engine.connect() as conn:
        values = {name: n for name, n in conn.execute(sa.select(counters.c.name, counters.c.n))}
        done = conn.execute(sa.select(sa.func.count()).select_from(jobs_table)).scalar_one()
    assert values == {"effects": workers * count, "plain": workers * count}
    assert done == workers * count
    for w in range(workers):
        assert last_fence(effects, f"writer:{w}") == count
    engine.dispose()


# -- a key rotation: two copies of one job under two secrets ---------------------------------


def _blocked_on_a_row_lock(effects: SqlEffects) -> bool:
    """Some session of this database waits for a row lock (the second copy's transaction)."""
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database()"
    )
    watcher = sa.create_engine(effects.engine.url, poolclass=sa.pool.NullPool)
    try:  # a connection of its own: never one the copies' pool hands out
        with watcher.connect() as conn:
            return int(conn.execute(sa.text(query)).scalar_one()) > 0
    finally:
        watcher.dispose()


@pytest.mark.parametrize("sql_url", ["postgresql"], indirect=True)  # where a wait shows
def test_two_copies_under_two_secrets_take_effect_once_side_by_side(effects: SqlEffects) -> None:
    """Found by the model's long run (issue 29): during a key rotation, after the lock
    server lost its data, a copy gated under each secret held a different key and ran at
    once; their effect transactions looked up each other's DONE row before either
    committed, and both wrote. Now a copy's transaction locks a row per key of the job
    under each secret: the second waits for the first, then finds its DONE row."""
    first_key, second_key = unique("under-a"), unique("under-b")
    first = dataclasses.replace(job(first_key, 10), previous=((second_key, "fp"),))
    # After the data loss: a higher fence, under the other secret.
    second = dataclasses.replace(job(second_key, 20), previous=((first_key, "fp"),))
    opened, go, second_opened = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def run_first() -> None:
        seen["first"] = pay(effects, first, during=lambda: (opened.set(), go.wait(10)))

    def run_second() -> None:
        with effects.transaction(second) as tx:
            second_opened.set()
            seen["second_done"] = tx.done
            if not tx.done:
                tx.conn.execute(ledger.insert().values(job=second_key, amount=100))
                tx.result = {"paid": 100}

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(run_first)
        assert opened.wait(10)
        b = pool.submit(run_second)
        wait_for(lambda: second_opened.is_set() or _blocked_on_a_row_lock(effects), 10.0,
                 interval=0.05)
        go.set()
        a.result(timeout=20)
        b.result(timeout=20)
    assert seen["first"][0] is False
    assert seen["second_done"] is True, "the second copy took effect beside the first"
    assert effect_rows(effects, first_key) + effect_rows(effects, second_key) == 1


# -- per run (lock_until="start", unique_for, debounce) -------------------------------------


def test_per_run_each_publish_takes_effect_once_whatever_its_arguments(
    effects: SqlEffects,
) -> None:
    """Issue 34 (debounce: each burst's run has the latest arguments): per run, each publish
    is a run of its own, with a DONE row of its own. A later run with other arguments met
    the first run's row as "the key used with other arguments"; one with the same arguments
    was answered by it and took no effect. A redelivery of a run still replays its own."""
    from jobfence.locks import MemoryBackend

    executor = Executor(MemoryBackend(), LeaseKeeper(), backoff=Backoff(0.005, 0.05))
    key, wrote = unique("tests.job:per-run"), []

    def body(ctx: Any) -> Any:
        with effects.transaction(ctx, "res:" + key) as tx:
            if not tx.done:
                wrote.append(ctx.task_id)
                tx.result = ctx.task_id
        return tx.result

    def run(task_id: str, fingerprint: str) -> Any:
        spec = spec_for(key, task_id=task_id, fingerprint=fingerprint, lock_until="start",
                        on_conflict="wait", queues=True)  # fmt: skip
        return executor.run(spec, body).value

    assert [run("T1", "a"), run("T2", "b"), run("T3", "a")] == ["T1", "T2", "T3"]
    assert wrote == ["T1", "T2", "T3"]
    # A run delivered again with its lock-server record gone (`jobfence locks forget`): its
    # own DONE row answers it, and it takes no effect twice.
    assert executor.backend.forget(key)
    assert run("T2", "b") == "T2" and wrote.count("T2") == 1
