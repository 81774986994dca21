"""The demo shop's app with its locks and its ledger in one PostgreSQL database, plus the control.

``celery -A tests.integration.apps.one_database_app worker`` runs the demo shop's
``tasks.payments.charge`` with JOBFENCE_LOCK_URL and JOBFENCE_DATABASE_URL naming the same
database, and ``naive.charge``: the seed article's lock, a session advisory lock
(``pg_try_advisory_lock``) in that same database, around a debit and a ledger row that
carry no idempotency record.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from celery import Task

from demo.app import create_shop_app
from demo.shop.ledger import accounts
from jobfence.tasks import make_engine, runtime_for

NAIVE_CHARGE = "naive.charge"

app = create_shop_app()

naive_metadata = sa.MetaData()
#: One row per naive charge that ran: no unique key, as in the seed article's ledger.
naive_charges = sa.Table(
    "naive_charges",
    naive_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("payment_id", sa.String(128), nullable=False, index=True),
    sa.Column("account", sa.String(128), nullable=False),
    sa.Column("amount_cents", sa.BigInteger, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)

_engine: sa.Engine | None = None


def engine() -> sa.Engine:
    """This process's engine on the ledger database (a forked child gets a fresh pool)."""
    global _engine
    if _engine is None:
        url = runtime_for(app).settings.database_url
        assert url, "JOBFENCE_DATABASE_URL is not set"
        _engine = make_engine(url)
    return _engine


@app.task(name=NAIVE_CHARGE, bind=True, acks_late=True, reject_on_worker_lost=True)
def naive_charge(self: Task, payment_id: str, account: str, amount_cents: int) -> str:
    """Take the payment's advisory lock or skip as a duplicate; debit; unlock."""
    with engine().connect() as conn:
        got = conn.execute(
            sa.text("SELECT pg_try_advisory_lock(hashtext(:id))"), {"id": payment_id}
        ).scalar_one()
        conn.commit()
        if not got:
            return "duplicate"
        try:
            with conn.begin():
                conn.execute(
                    sa.update(accounts)
                    .where(accounts.c.account == account)
                    .values(balance_cents=accounts.c.balance_cents - amount_cents)
                )
                conn.execute(
                    naive_charges.insert().values(
                        payment_id=payment_id,
                        account=account,
                        amount_cents=amount_cents,
                        pid=os.getpid(),
                    )
                )
        finally:
            conn.execute(sa.text("SELECT pg_advisory_unlock(hashtext(:id))"), {"id": payment_id})
            conn.commit()
    return "charged"
