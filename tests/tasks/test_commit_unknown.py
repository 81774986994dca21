"""The effect's COMMIT on a real PostgreSQL whose connection dies there: settled, or redelivered.

Two faults at the one moment whose outcome the client cannot know: the server's backend is
terminated as COMMIT is sent (the transaction did not land), and a TCP proxy forwards the
COMMIT but drops its reply and the link (it did land). Either way the job takes effect once
and ends DONE; the control shows a plain transaction under the same fault acked FAILED with
no effect.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery.exceptions import Ignore
from sqlalchemy.exc import OperationalError

from jobfence.locks import Backoff, LeaseKeeper, RedisBackend
from jobfence.tasks import (
    Executor,
    JobContext,
    Outcome,
    Redelivery,
    SqlEffects,
    make_engine,
    singleton_task,
)
from jobfence.tasks.celery_task import REDELIVERIES
from tests.pg_cut import CommitReplyCutter
from tests.servers import HOST
from tests.tasks.conftest import AppFactory, spec_for, unique

pytestmark = pytest.mark.fault

ledger_meta = sa.MetaData()
ledger = sa.Table(
    "commit_ledger",
    ledger_meta,
    sa.Column("job_key", sa.String(255), nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)


# --------------------------------------------------------------------------- faults


def kill_backend_at_commit(engine: sa.Engine, admin: sa.Engine) -> threading.Event:
    """Terminate the server process of the next connection that COMMITs, just before the
    COMMIT is sent (the `commit` event runs first): the transaction never lands."""
    fired = threading.Event()

    def on_commit(conn: sa.Connection) -> None:
        if fired.is_set():
            return
        fired.set()
        pid = conn.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
        with admin.connect() as other:  # waits (up to 10 s) until the process is gone
            assert other.scalar(sa.text("SELECT pg_terminate_backend(:p, 10000)"), {"p": pid})

    sa.event.listen(engine, "commit", on_commit)
    return fired


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def admin(pg_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pg_url)
    ledger_meta.create_all(engine)
    yield engine
    engine.dispose()


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
    fired = kill_backend_at_commit(effects.engine, admin)
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
    fired = kill_backend_at_commit(effects.engine, admin)
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


def test_the_readme_charge_task_in_a_worker_is_published_again_not_acked_failed(
    make_app: AppFactory, effects: SqlEffects, admin: sa.Engine, redis_client: Any
) -> None:
    """As a worker runs it (no autoretry_for): the COMMIT is lost, the message comes back
    with the same task id and idempotency key, and that copy takes effect once."""
    import json

    app = make_app(eager=False)
    runs: list[int] = []
    body = _charge(effects, runs)

    @singleton_task(app=app, bind=True, key=["payment_id"], name=unique("tests.charge"))
    def charge(self: Any, payment_id: str) -> Any:
        return body(self.job)

    kill_backend_at_commit(effects.engine, admin)
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
    assert _rows(admin, key) == [runs[1]]
