"""kill -9 of a private PostgreSQL during held leases: records kept, fences rising, no job lost.

Fault: leases held and a job mid-body on a private cluster (`tests.servers.PostgresServer`)
when its postmaster gets SIGKILL; it is started again on the same data directory (crash
recovery from the WAL).

What the backend promises: lease statements commit with ``synchronous_commit=off``, so a
crash may forget the last grants. A holder whose grant was forgotten (or kept) learns it at
its next extension: it either still owns the lease (and nobody else gets it) or its extend
is refused; never both holders. Job records (DONE) are flushed before the answer and
survive. Each key's next fence is above every fence handed out before the crash (server
µs clock floor), and a job whose worker lost its lease to the crash runs once afterwards.

Control: a naive counter fence kept in an UNLOGGED table (fast, like a cache) is emptied by
crash recovery and hands out values it already gave.

A restart (fast shutdown) while a job's effect transaction is open, as its DONE row is
inserted: nothing committed, the job is delivered again (again while the server is down),
and runs once when it is back; never acked FAILED.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from jobfence.locks import Busy, JobRecord, Lease, NotOwner, StaleFence
from jobfence.locks.acquire import Backoff
from jobfence.locks.backends.memory import MemoryBackend
from jobfence.locks.backends.postgres import PostgresBackend
from jobfence.locks.guards import SqlFenceGuard
from jobfence.locks.keeper import LeaseKeeper
from jobfence.tasks.context import JobContext
from jobfence.tasks.effects import SqlEffects, make_engine
from jobfence.tasks.executor import Executor, JobSpec
from jobfence.tasks.lifecycle import Redelivery
from tests.servers import PostgresServer, PostgresServerError

pytestmark = pytest.mark.fault

SLACK = 30.0  # generous: crash recovery and interpreter work on a loaded 2-core box


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    """One private cluster for the module (initdb takes seconds); each test kills it."""
    reason = PostgresServer.unavailable()
    if reason is not None:
        pytest.skip(reason)
    try:
        srv = PostgresServer()
    except PostgresServerError as exc:
        pytest.skip(f"cannot start a private PostgreSQL here: {exc}")
    with srv:
        yield srv


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"crash_{request.node.name[-20:]}_{time.monotonic_ns() % 10**6}"


def test_control_an_unlogged_counter_fence_repeats_after_kill_9(server: PostgresServer) -> None:
    engine = sa.create_engine(server.url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS naive_fence"))
            conn.execute(sa.text("CREATE UNLOGGED TABLE naive_fence (n bigint NOT NULL)"))
            conn.execute(sa.text("INSERT INTO naive_fence VALUES (0)"))

        def grant() -> int:
            with engine.begin() as conn:
                row = conn.execute(sa.text("UPDATE naive_fence SET n = n + 1 RETURNING n"))
                value = row.scalar()
                if value is None:  # emptied by crash recovery: start again
                    conn.execute(sa.text("INSERT INTO naive_fence VALUES (1)"))
                    value = 1
                return int(value)

        before = [grant() for _ in range(20)]
        assert before == list(range(1, 21))
        server.kill9()
        server.start()
        after = grant()
        # The double fence: a value already handed out before the crash comes again.
        assert after <= max(before) and after in before
    finally:
        engine.dispose()


def test_kill_9_keeps_records_fence_order_and_the_job(server: PostgresServer, prefix: str) -> None:
    backend = PostgresBackend.from_url(server.url, prefix=prefix, socket_timeout=2.0)
    other = PostgresBackend.from_url(server.url, prefix=prefix, socket_timeout=2.0)
    engine = sa.create_engine(server.url, pool_pre_ping=True)
    guard = SqlFenceGuard()
    ledger = f"{prefix}_ledger"
    keeper = LeaseKeeper()
    try:
        guard.create_schema(engine)
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {ledger} (job text, fence bigint)"))

        def body(job: JobContext) -> str:
            with guard.transaction(engine, f"ledger:{job.key}", job.fence) as conn:
                conn.execute(
                    sa.text(f"INSERT INTO {ledger} VALUES (:j, :f)"), {"j": job.key, "f": job.fence}
                )
            return "charged"

        # Before the crash: grants cycled on one key, a lease held, a job DONE, a job mid-body.
        cycled = []
        for _ in range(20):
            lease = backend.try_acquire("cycle", 30.0)
            assert lease is not None
            cycled.append(lease.fence)
            assert lease.release()
        held = backend.try_acquire("held", 60.0)
        assert held is not None
        executor = Executor(backend, keeper, backoff=Backoff())
        spec_done = JobSpec(name="pay", key="done", fingerprint="fp", ttl=5.0, result_ttl=600)
        assert executor.run(spec_done, body).status == "ran"
        done_record = backend.job_record("done")
        assert done_record is not None and done_record.state == "DONE"
        midway = backend.begin("midway", 3.0, record=True, fingerprint="fp")
        assert isinstance(midway, Lease)
        before_max = {"cycle": max(cycled), "held": held.fence, "midway": midway.fence}

        server.kill9()
        server.start()

        # The held lease is as the backend promises: kept (nobody else gets it and its
        # holder extends it) or forgotten (then its holder's next extension is refused).
        contender = other.attempt("held", 60.0)
        if isinstance(contender, Busy):
            backend.extend(held)  # kept: still ours, over a new connection
            assert held.release()
        else:
            assert contender.fence > held.fence  # forgotten: a newer holder, higher fence
            with pytest.raises(NotOwner):
                backend.extend(held)
            assert contender.release()

        # The DONE record committed before the crash survived: a redelivery does not run.
        again = executor.run(spec_done, body)
        assert again.status != "ran", again
        record = other.begin("done", 5.0, record=True, fingerprint="fp")
        assert isinstance(record, JobRecord) and record.fence == done_record.fence

        # Fences keep strictly increasing per key, from a client that never saw one.
        for key in ("cycle", "held"):
            lease = other.try_acquire(key, 5.0)
            assert lease is not None and lease.fence > before_max[key], key
            assert lease.release()

        # The job whose worker was mid-body is not lost: a redelivery waits out (or finds
        # forgotten) the old lease and runs it once, under a higher fence; the old holder's
        # late write is refused by the guard.
        spec_mid = JobSpec(
            name="pay", key="midway", fingerprint="fp", ttl=5.0, result_ttl=600,
            on_conflict="wait", wait_timeout=SLACK,
        )  # fmt: skip
        outcome = executor.run(spec_mid, body)
        assert outcome.status == "ran", outcome
        final = backend.job_record("midway")
        assert final is not None and final.state == "DONE" and final.fence > before_max["midway"]
        late = guard.transaction(engine, "ledger:midway", midway.fence)
        with pytest.raises(StaleFence), late as conn:
            conn.execute(sa.text(f"INSERT INTO {ledger} VALUES ('midway', :f)"),
                         {"f": midway.fence})  # fmt: skip
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT job, fence FROM {ledger} ORDER BY job")).all()
        assert [tuple(r) for r in rows] == [
            ("done", done_record.fence),
            ("midway", final.fence),
        ]
    finally:
        keeper.stop()
        backend.close()
        other.close()
        engine.dispose()


def test_a_restart_inside_the_effect_transaction_delivers_the_job_again_and_it_runs_once(
    server: PostgresServer, prefix: str
) -> None:
    effects = SqlEffects(make_engine(server.url))
    ledger = f"{prefix}_restart_ledger"
    keeper = LeaseKeeper()
    executor = Executor(
        MemoryBackend(), keeper, backoff=Backoff(), redelivery=Redelivery(base=0.05, cap=0.2)
    )
    runs: list[int] = []
    restarted: list[str] = []

    def stop_at_done_row(_conn: object, _cur: object, sql: str, *_: object) -> None:
        if not restarted and "INSERT INTO jobfence_jobs" in sql:
            restarted.append(sql)
            server.stop()  # every session terminated; the INSERT goes to a closed link

    def charge(job: JobContext) -> object:
        runs.append(job.fence)
        with effects.transaction(job, f"payment:{job.key}") as tx:
            if tx.done:
                return tx.result
            tx.conn.execute(sa.text(f"INSERT INTO {ledger} VALUES (:j, :f)"),
                            {"j": job.key, "f": job.fence})  # fmt: skip
            tx.result = {"charged": job.fence}
        return tx.result

    try:
        effects.create_schema()
        with effects.engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {ledger} (job text, fence bigint)"))
        sa.event.listen(effects.engine, "before_cursor_execute", stop_at_done_row)
        statuses = []
        for redeliveries in range(3):
            if redeliveries == 2:
                server.start()
            spec = JobSpec(name="pay", key="restart", fingerprint="fp", ttl=5.0,
                           result_ttl=600, redeliveries=redeliveries)  # fmt: skip
            statuses.append(executor.run(spec, charge).status)
        # Lost mid-transaction, then unreachable: delivered again each time, never FAILED.
        assert restarted and statuses == ["redeliver", "redeliver", "ran"], statuses
        with effects.engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT fence FROM {ledger}")).scalars().all()
        assert rows == [runs[-1]]  # once, by the delivery that ran
        assert effects.record("restart") is not None
    finally:
        if server.pid is None:
            server.start()
        keeper.stop()
        effects.engine.dispose()
