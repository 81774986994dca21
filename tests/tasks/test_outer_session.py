"""SqlEffects inside an SQLAlchemy Session the caller owns, on real PostgreSQL and Redis.

The effect is a savepoint of the caller's transaction: a rollback takes it back and leaves
no record on the lock server (the job runs again, once); a commit stores DONE after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from jobfence.tasks import SqlEffects, make_engine, runtime_for, singleton_task
from tests.tasks.conftest import AppFactory, unique

ledger_meta = sa.MetaData()
ledger = sa.Table(
    "session_ledger",
    ledger_meta,
    sa.Column("payment_id", sa.String(64), nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)


@pytest.fixture
def effects(pg_url: str) -> Iterator[SqlEffects]:
    fx = SqlEffects(make_engine(pg_url))
    fx.create_schema()
    ledger_meta.create_all(fx.engine)
    yield fx
    fx.engine.dispose()


@pytest.fixture
def charge(make_app: AppFactory, effects: SqlEffects) -> Any:
    """The README's task, writing through the Session the caller put in `charge.session`."""
    app = make_app()
    runs: list[int] = []

    @singleton_task(app=app, bind=True, key=["payment_id"], name=unique("tests.charge"))
    def charge(self: Any, payment_id: str, amount: int) -> Any:
        runs.append(self.job.fence)
        session = charge.session
        with effects.transaction(self.job, f"payment:{payment_id}", session=session) as tx:
            if tx.done:
                return tx.result
            tx.conn.execute(ledger.insert().values(payment_id=payment_id, fence=self.job.fence))
            tx.result = {"charged": amount}
        return tx.result

    charge.runs = runs
    return charge


def _rows(fx: SqlEffects, payment_id: str) -> list[int]:
    with fx.engine.connect() as conn:
        rows = conn.execute(sa.select(ledger.c.fence).where(ledger.c.payment_id == payment_id))
        return [r.fence for r in rows]


def _record(task: Any, *args: Any) -> Any:
    key, _ = task.identity(args, {})
    return runtime_for(task.app).backend.job_record(key)


def test_a_callers_session_rolled_back_leaves_no_record_and_the_job_runs_again(
    charge: Any, effects: SqlEffects
) -> None:
    pay = unique("pay")
    with Session(effects.engine) as session:
        charge.session = session
        assert charge(pay, 5) == {"charged": 5}
        assert charge.apply(args=(pay, 5)).get() == {"charged": 5}  # its own DONE row
        session.rollback()
    assert _rows(effects, pay) == []
    assert _record(charge, pay, 5) is None
    with Session(effects.engine) as session:
        charge.session = session
        assert charge(pay, 5) == {"charged": 5}
        session.commit()
    assert len(charge.runs) == 3 and _rows(effects, pay) == [charge.runs[2]]


def test_a_callers_session_committed_records_done_after_the_commit(
    charge: Any, effects: SqlEffects
) -> None:
    pay = unique("pay")
    with Session(effects.engine) as session:
        charge.session = session
        assert charge(pay, 9) == {"charged": 9}
        assert _record(charge, pay, 9) is None  # not while the caller's transaction is open
        session.commit()
    record = _record(charge, pay, 9)
    assert record is not None and record.state == "DONE"
    assert charge(pay, 9) == {"charged": 9}  # replayed from the record: the body never ran
    assert len(charge.runs) == 1 and len(_rows(effects, pay)) == 1
