"""The effect's transaction on a real database whose connection dies in it: settled, or redelivered.

The server's session is killed just before each statement of the effect's transaction (the
fence check, the DONE look-up, the body's own insert, the DONE row's insert, the COMMIT), on
PostgreSQL (pg_terminate_backend) and MariaDB (KILL): nothing committed, so the job is
delivered again and takes effect once, never acked FAILED. A TCP proxy that forwards the
COMMIT but drops its reply and the link (it did land) settles DONE from the DONE row. The
controls: a plain transaction under the same cut is acked FAILED with no effect, and a
user's own integrity error on a live connection stays a failure (no redelivery loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery.exceptions import Ignore
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from jobfence.locks import Backoff, CommitOutcomeUnknown, LeaseKeeper, RedisBackend
from jobfence.locks.guards import SqlFenceGuard
from jobfence.tasks import (
    Executor,
    JobContext,
    Outcome,
    Redelivery,
    SqlEffects,
    make_engine,
    singleton_task,
)
from jobfence.tasks.flow.marks import REDELIVERIES_HEADER as REDELIVERIES
from tests.pg_cut import CommitReplyCutter, kill_session_at
from tests.servers import HOST
from tests.tasks.conftest import AppFactory, job_with_fence, spec_for, unique

pytestmark = pytest.mark.fault

ledger_meta = sa.MetaData()
ledger = sa.Table(
    "commit_ledger",
    ledger_meta,
    sa.Column("job_key", sa.String(255), nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)
#: One row per payment, as the README's ledger: a second insert is the user's IntegrityError.
payments = sa.Table(
    "commit_payments",
    ledger_meta,
    sa.Column("payment_id", sa.String(64), primary_key=True),
    sa.Column("fence", sa.BigInteger, nullable=False),
)

#: Each statement of the effect's transaction, in order; the session is killed just before it.
EFFECT_STATEMENTS = [
    "INSERT INTO jobfence_fences",  # the fence check-and-advance
    "FROM jobfence_jobs",  # the DONE row's look-up
    "INSERT INTO commit_ledger",  # the body's own write
    "INSERT INTO jobfence_jobs",  # the DONE row
    "COMMIT",
]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def admin(pg_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pg_url)
    ledger_meta.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture(params=["postgresql", "mariadb"])
def db_admin(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    """The ledger's database, PostgreSQL or MariaDB, for killing sessions and reading back."""
    url = request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[request.param])
    engine = sa.create_engine(url)
    ledger_meta.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def db_effects(db_admin: sa.Engine) -> Iterator[SqlEffects]:
    fx = SqlEffects(make_engine(db_admin.url.render_as_string(hide_password=False)))
    fx.create_schema()
    yield fx
    fx.engine.dispose()


@pytest.fixture
def effects(pg_url: str, admin: sa.Engine) -> Iterator[SqlEffects]:
    fx = SqlEffects(make_engine(pg_url))
    fx.create_schema()
    yield fx
    fx.engine.dispose()


@pytest.fixture
def cutter(pg_url: str, admin: sa.Engine) -> Iterator[tuple[CommitReplyCutter, SqlEffects]]:
    url = sa.make_url(pg_url)
    proxy = CommitReplyCutter(url.port or 5432)
    # No TLS through the proxy: it reads the COMMIT off the wire.
    through = url.set(host=HOST, port=proxy.port, query={"sslmode": "disable"})
    fx = SqlEffects(make_engine(through.render_as_string(hide_password=False)))
    fx.create_schema()
    yield proxy, fx
    fx.engine.dispose()
    proxy.close()


@pytest.fixture
def lock_keeper() -> Iterator[LeaseKeeper]:
    k = LeaseKeeper()
    yield k
    k.stop()


@pytest.fixture
def pg_executor(redis_backend: RedisBackend, lock_keeper: LeaseKeeper) -> Executor:
    return Executor(
        redis_backend,
        lock_keeper,
        backoff=Backoff(0.005, 0.05),
        redelivery=Redelivery(base=0.05, cap=0.2),
    )


def _charge(fx: SqlEffects, runs: list[int]) -> Callable[[JobContext], Any]:
    def body(ctx: JobContext) -> Any:
        runs.append(ctx.fence)
        with fx.transaction(ctx, f"job:{ctx.key}") as tx:
            if tx.done:
                return tx.result
            tx.conn.execute(ledger.insert().values(job_key=ctx.key, fence=ctx.fence))
            tx.result = {"charged": ctx.fence}
        return tx.result

    return body


def _until_settled(
    executor: Executor, key: str, body: Callable[[JobContext], Any]
) -> list[Outcome]:
    """Deliver the job as a broker would: again after each `redeliver`, at most five times."""
    outcomes = [executor.run(spec_for(key), body)]
    while outcomes[-1].status == "redeliver" and len(outcomes) < 5:
        outcomes.append(executor.run(spec_for(key, redeliveries=len(outcomes)), body))
    return outcomes


def _rows(engine: sa.Engine, key: str) -> list[int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(ledger.c.fence).where(ledger.c.job_key == key))
        return [r.fence for r in rows]


# --------------------------------------------------------------------------- tests


def test_a_connection_killed_at_the_effect_commit_is_delivered_again_and_takes_effect_once(
    pg_executor: Executor, effects: SqlEffects, admin: sa.Engine, redis_backend: RedisBackend
) -> None:
    fired = kill_session_at(effects.engine, admin, "COMMIT")
    key, runs = unique(), []
    outcomes = _until_settled(pg_executor, key, _charge(effects, runs))
    assert fired.is_set()
    assert [o.status for o in outcomes] == ["redeliver", "ran"], outcomes
    assert "commit outcome unknown" in outcomes[0].reason
    assert _rows(admin, key) == [runs[1]]  # the first COMMIT never landed; the second did
    assert outcomes[1].value == {"charged": runs[1]}
    record = redis_backend.job_record(key)
    assert record is not None and record.state == "DONE"


def test_control_a_plain_transaction_killed_at_commit_ends_failed_with_no_effect(
    pg_executor: Executor, effects: SqlEffects, admin: sa.Engine, redis_backend: RedisBackend
) -> None:
    fired = kill_session_at(effects.engine, admin, "COMMIT")
    key = unique()

    def plain(ctx: JobContext) -> Any:  # the write as a task without jobfence's effects does it
        with effects.engine.begin() as conn:
            conn.execute(ledger.insert().values(job_key=ctx.key, fence=ctx.fence))
        return {"charged": ctx.fence}

    with pytest.raises(OperationalError):
        pg_executor.run(spec_for(key), plain)
    assert fired.is_set()
    assert _rows(admin, key) == []  # the job is lost: acked FAILED, nothing queued
    record = redis_backend.job_record(key)
    assert record is not None and record.state == "FAILED"


def test_a_commit_that_landed_with_its_reply_lost_settles_done_with_one_effect(
    pg_executor: Executor,
    cutter: tuple[CommitReplyCutter, SqlEffects],
    admin: sa.Engine,
    redis_backend: RedisBackend,
) -> None:
    proxy, fx = cutter
    key, runs = unique(), []
    body = _charge(fx, runs)
    with fx.engine.connect():
        pass  # the schema and the pool's first connection, before the proxy is armed
    proxy.armed.set()
    outcomes = _until_settled(pg_executor, key, body)
    assert proxy.fired.is_set()
    assert [o.status for o in outcomes] == ["ran"], outcomes  # read back, not run again
    assert runs == [outcomes[0].fence]
    assert _rows(admin, key) == runs
    record = redis_backend.job_record(key)
    assert record is not None and record.state == "DONE"
    # A later delivery is answered from the record.
    assert pg_executor.run(spec_for(key), body).status == "replayed"
    assert len(runs) == 1


@pytest.mark.parametrize("statement", ["INSERT INTO jobfence_jobs", "COMMIT"])
def test_the_readme_charge_task_in_a_worker_is_published_again_not_acked_failed(
    make_app: AppFactory, effects: SqlEffects, admin: sa.Engine, redis_client: Any,
    statement: str,
) -> None:  # fmt: skip
    """As a worker runs it (no autoretry_for): the connection is lost as the DONE row is
    inserted or at COMMIT, the message comes back with the same task id and idempotency
    key, and that copy takes effect once."""
    import json

    app = make_app(eager=False)
    runs: list[int] = []
    body = _charge(effects, runs)

    @singleton_task(app=app, bind=True, key=["payment_id"], name=unique("tests.charge"))
    def charge(self: Any, payment_id: str) -> Any:
        return body(self.job)

    fired = kill_session_at(effects.engine, admin, statement)
    headers: dict[str, Any] = {}
    for attempt in range(2):
        charge.push_request(
            id="task-1", args=["pay-1"], kwargs={}, retries=0, headers=headers,
            delivery_info={"exchange": "", "routing_key": "celery"},
            called_directly=False, is_eager=False,
        )  # fmt: skip
        try:
            if attempt == 0:
                with pytest.raises(Ignore):  # acked: a copy is on the broker
                    charge._gated(("pay-1",), {})
                message = json.loads(redis_client.lpop("celery"))
                headers = message["headers"]
                assert headers["id"] == "task-1" and headers[REDELIVERIES] == 1
            else:
                assert charge._gated(("pay-1",), {}) == {"charged": runs[1]}
        finally:
            charge.pop_request()
    key, _ = charge.identity(("pay-1",), {})
    assert fired.is_set()
    assert _rows(admin, key) == [runs[1]]


# ------------------------------------------------------- lost inside the transaction


@pytest.mark.parametrize("statement", EFFECT_STATEMENTS)
def test_a_connection_killed_at_any_statement_of_the_effect_is_delivered_again_once(
    pg_executor: Executor, db_effects: SqlEffects, db_admin: sa.Engine,
    redis_backend: RedisBackend, statement: str,
) -> None:  # fmt: skip
    fired = kill_session_at(db_effects.engine, db_admin, statement)
    key, runs = unique(), []
    body = _charge(db_effects, runs)
    outcomes = _until_settled(pg_executor, key, body)
    assert fired.is_set()
    assert [o.status for o in outcomes] == ["redeliver", "ran"], outcomes  # never FAILED
    assert "commit outcome unknown" in outcomes[0].reason
    assert _rows(db_admin, key) == [runs[1]]  # the first delivery committed nothing
    assert outcomes[1].value == {"charged": runs[1]}
    record = redis_backend.job_record(key)
    assert record is not None and record.state == "DONE"
    assert db_effects.record(key) is not None
    assert pg_executor.run(spec_for(key), body).status == "replayed"
    assert len(runs) == 2


def test_control_a_plain_transaction_killed_at_its_insert_ends_failed_with_no_effect(
    pg_executor: Executor, db_effects: SqlEffects, db_admin: sa.Engine,
    redis_backend: RedisBackend,
) -> None:  # fmt: skip
    fired = kill_session_at(db_effects.engine, db_admin, "INSERT INTO commit_ledger")
    key = unique()

    def plain(ctx: JobContext) -> Any:
        with db_effects.engine.begin() as conn:
            conn.execute(ledger.insert().values(job_key=ctx.key, fence=ctx.fence))
        return {"charged": ctx.fence}

    with pytest.raises(OperationalError):
        pg_executor.run(spec_for(key), plain)
    assert fired.is_set()
    assert _rows(db_admin, key) == []  # lost: acked FAILED, nothing queued
    record = redis_backend.job_record(key)
    assert record is not None and record.state == "FAILED"


def test_a_users_own_integrity_error_in_the_effect_stays_a_failure(
    pg_executor: Executor, db_effects: SqlEffects, db_admin: sa.Engine,
    redis_backend: RedisBackend,
) -> None:  # fmt: skip
    payment, key, runs = unique("pay"), unique(), []
    with db_admin.begin() as conn:  # the payment is already in the ledger
        conn.execute(payments.insert().values(payment_id=payment, fence=0))

    def charge(ctx: JobContext) -> Any:  # the README's shape
        runs.append(ctx.fence)
        with db_effects.transaction(ctx, f"payment:{payment}") as tx:
            if tx.done:
                return tx.result
            tx.conn.execute(payments.insert().values(payment_id=payment, fence=ctx.fence))
            tx.result = {"charged": 1250}
        return tx.result

    with pytest.raises(IntegrityError):
        pg_executor.run(spec_for(key), charge)
    assert len(runs) == 1  # not delivered again
    record = redis_backend.job_record(key)
    assert record is not None and record.state == "FAILED"
    assert db_effects.record(key) is None


@pytest.mark.parametrize("statement", ["INSERT INTO jobfence_fences", "INSERT INTO commit_ledger"])
def test_a_guard_transaction_killed_before_its_commit_is_delivered_again_and_writes_once(
    pg_executor: Executor, db_effects: SqlEffects, db_admin: sa.Engine, statement: str
) -> None:
    engine, guard = db_effects.engine, SqlFenceGuard()
    fired = kill_session_at(engine, db_admin, statement)
    key, runs = unique(), []

    def body(ctx: JobContext) -> Any:
        runs.append(ctx.fence)
        with guard.transaction(engine, f"job:{ctx.key}", ctx.fence) as conn:
            conn.execute(ledger.insert().values(job_key=ctx.key, fence=ctx.fence))
        return "written"

    outcomes = _until_settled(pg_executor, key, body)
    assert fired.is_set()
    assert [o.status for o in outcomes] == ["redeliver", "ran"], outcomes
    assert _rows(db_admin, key) == [runs[1]]


def test_a_guard_transaction_lost_inside_raises_outcome_unknown_saying_nothing_committed(
    db_effects: SqlEffects, db_admin: sa.Engine
) -> None:
    engine, resource = db_effects.engine, unique("res")
    kill_session_at(engine, db_admin, "INSERT INTO commit_ledger")
    with (
        pytest.raises(CommitOutcomeUnknown, match="before its COMMIT: nothing committed"),
        SqlFenceGuard().transaction(engine, resource, 5) as conn,
    ):
        conn.execute(ledger.insert().values(job_key=resource, fence=5))
    assert _rows(db_admin, resource) == []


def test_an_effect_in_the_callers_session_lost_inside_raises_outcome_unknown(
    db_effects: SqlEffects, db_admin: sa.Engine
) -> None:
    key = unique()
    kill_session_at(db_effects.engine, db_admin, "INSERT INTO commit_ledger")
    job = job_with_fence(key, 5)
    with (
        pytest.raises(CommitOutcomeUnknown, match="nothing committed"),
        Session(db_effects.engine) as session,
        session.begin(),
        db_effects.transaction(job, f"job:{key}", session=session) as tx,
    ):
        tx.conn.execute(ledger.insert().values(job_key=key, fence=5))
        tx.result = "written"
    assert _rows(db_admin, key) == [] and db_effects.record(key) is None


def _until_session_ended(admin: sa.Engine, pid: int) -> None:
    """Poll until the server has ended session `pid` (its idle-in-transaction timeout)."""
    import time

    deadline = time.monotonic() + 30
    query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p")
    with admin.connect() as other:
        while other.execute(query, {"p": pid}).scalar():
            assert time.monotonic() < deadline, "the session was never timed out"
            other.rollback()  # a fresh snapshot of pg_stat_activity
            time.sleep(0.02)


@pytest.mark.parametrize("where", ["after the body's insert", "just before COMMIT"])
def test_an_idle_in_transaction_timeout_inside_the_effect_is_delivered_again_once(
    pg_executor: Executor, effects: SqlEffects, admin: sa.Engine, where: str
) -> None:
    """The server ends the session itself: the first run idles past the transaction's idle
    timeout, so the next statement (the DONE row's insert, or COMMIT) meets a closed session
    (psycopg's IdleInTransactionSessionTimeout, an InternalError to SQLAlchemy)."""
    key, runs, pids = unique(), [], []

    def idle_at_commit(conn: sa.Connection) -> None:
        if pids and len(runs) == 1:
            _until_session_ended(admin, pids[0])

    sa.event.listen(effects.engine, "commit", idle_at_commit)

    def charge(ctx: JobContext) -> Any:
        runs.append(ctx.fence)
        with effects.transaction(ctx, f"job:{ctx.key}") as tx:
            if tx.done:
                return tx.result
            tx.conn.execute(ledger.insert().values(job_key=ctx.key, fence=ctx.fence))
            if len(runs) == 1:
                tx.conn.exec_driver_sql("SET LOCAL idle_in_transaction_session_timeout = 50")
                pids.append(tx.conn.connection.driver_connection.info.backend_pid)  # type: ignore[union-attr]
                if where == "after the body's insert":
                    _until_session_ended(admin, pids[0])
            tx.result = {"charged": ctx.fence}
        return tx.result

    outcomes = _until_settled(pg_executor, key, charge)
    assert [o.status for o in outcomes] == ["redeliver", "ran"], outcomes
    assert _rows(admin, key) == [runs[1]]
