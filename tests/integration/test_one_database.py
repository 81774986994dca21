"""A payment storm on PostgreSQL that keeps lock, fence, job record and effect in one database.

Real `celery worker` processes run the shipped `tasks.payments.charge` with JOBFENCE_LOCK_URL
and JOBFENCE_DATABASE_URL naming the same scratch database. Each payment is published three
times (some copies at once, the rest after the first run ended): each is charged exactly once
and none is lost, and one connection to that database finds the lease row, the fence, both
job records and the ledger row of every payment.

What commits together: the ledger row, the debit, the fence check-and-advance and the DONE
row in `jobfence_jobs` are one transaction (PostgreSQL stamps all their row versions with
the same xmin). The lease's own record and release (`jobfence_locks`) commit in a second
transaction, on the lock backend's connection, after the body returned: the executor
stores the body's return value only once it has it, and the backend's connection is not
the one the body's transaction ran on. A crash between the two commits is safe: the next
delivery gets the lease, the body finds its DONE row in `jobfence_jobs` and returns the
stored result without charging again.

The control runs the same storm through the seed article's lock, a session advisory lock in
the same database around the same debit: every copy that comes after the first run ended
finds the lock free and charges again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from demo.shop.ledger import balance_of, create_schema, open_account
from demo.shop.payments import CHARGE
from jobfence.config import Settings
from jobfence.tasks import runtime_for
from jobfence.tasks.effects import make_engine
from jobfence.worker.app import create_app
from tests.integration.apps.one_database_app import NAIVE_CHARGE, naive_metadata
from tests.integration.celery_fleet import Fleet, FleetFactory
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase, RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.one_database_app"
PAYMENTS = 24
COPIES = 3  # publishes per payment
ACCOUNTS = 4
OPENING = 1_000_000  # cents: no charge is declined
SETTLE = 90.0  # seconds a phase of the storm may take on a loaded two-core machine


@dataclass
class OneDatabase:
    fleet: Fleet
    client: Celery
    broker: redis.Redis
    engine: sa.Engine
    url: str
    prefix: str

    def psycopg(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url.replace("postgresql+psycopg://", "postgresql://"))


@pytest.fixture(scope="module")
def one_db(module_redis: RedisServer, fleet_factory: FleetFactory) -> Iterator[OneDatabase]:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    server = f"redis://{module_redis.host}:{module_redis.port}"
    with PostgresDatabase() as db:
        prefix = "onedb"
        settings = Settings(
            lock_url=db.url,  # the lease table and its fence sequence ...
            database_url=db.url,  # ... beside the ledger, the fences and the DONE rows
            broker_url=f"{server}/0",
            result_backend=f"{server}/1",
            key_prefix=prefix,
        )
        engine = make_engine(db.url)
        create_schema(engine)
        naive_metadata.create_all(engine)
        env = {
            "JOBFENCE_LOCK_URL": settings.lock_url,
            "JOBFENCE_DATABASE_URL": db.url,
            "JOBFENCE_BROKER_URL": f"{server}/0",
            "JOBFENCE_RESULT_BACKEND": f"{server}/1",
            "JOBFENCE_KEY_PREFIX": prefix,
        }
        fleet = fleet_factory(APP, env=env, workers=2, concurrency=2)
        client = create_app(settings, include=["demo.shop.payments"])
        broker = redis.Redis.from_url(f"{server}/0")
        try:
            yield OneDatabase(fleet, client, broker, engine, db.url, prefix)
        finally:
            fleet.stop()  # before the database goes
            broker.close()
            runtime_for(client).close()
            client.close()
            engine.dispose()


def storm(db: OneDatabase, task: str, payments: list[tuple[Any, ...]]) -> None:
    """Publish every payment COPIES times: the first copy (and for every third payment a
    second one at once), then, once the fleet is idle, the rest."""
    late = []
    for i, args in enumerate(payments):
        db.client.send_task(task, args=list(args))
        early = 2 if i % 3 == 0 else 1
        for _ in range(early - 1):
            db.client.send_task(task, args=list(args))
        late += [args] * (COPIES - early)
    db.fleet.wait_idle(db.broker, timeout=SETTLE)
    for args in late:
        db.client.send_task(task, args=list(args))
    db.fleet.wait_idle(db.broker, timeout=SETTLE)


def plan(side: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    run = uuid.uuid4().hex[:6]
    accounts = [f"{side}-{run}-acct-{i}" for i in range(ACCOUNTS)]
    payments = [
        (f"{side}-{run}-pay-{i:03d}", accounts[i % ACCOUNTS], 100 + i) for i in range(PAYMENTS)
    ]
    return accounts, payments


def deliveries(db: OneDatabase, task: str) -> int:
    return sum(1 for e in db.fleet.events() if e.kind == "prerun" and e.task == task)


def test_a_payment_storm_charges_each_payment_once_with_everything_in_one_database(
    one_db: OneDatabase,
) -> None:
    db = one_db
    accounts, payments = plan("jf")
    for account in accounts:
        open_account(db.engine, account, currency="EUR", balance_cents=OPENING)
    before = deliveries(db, CHARGE)
    storm(db, CHARGE, [(p, a, amount, "EUR") for p, a, amount in payments])
    assert deliveries(db, CHARGE) - before >= PAYMENTS * COPIES  # every copy was delivered

    task = db.client.tasks[CHARGE]
    keys = {p: task.identity([p, a, amount, "EUR"], {}, None)[0] for p, a, amount in payments}
    with db.psycopg() as conn:
        # One database: the lock's tables, the guard's, the job records and the ledger.
        assert conn.execute("SELECT current_database()").fetchone() == (db.url.rsplit("/", 1)[1],)
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables")}
        assert {"jobfence_locks", "jobfence_fences", "jobfence_jobs", "payments"} <= tables
        (seq,) = conn.execute("SELECT last_value FROM jobfence_lock_fence_seq").fetchone() or (0,)
        assert seq > 0  # the lease fences' source lives here too
        rows = {
            pid: conn.execute(
                """
                SELECT l.owner, l.rec_state, l.rec_fence, l.xmin::text,
                       j.state, j.fence, j.result, j.xmin::text,
                       f.fence, f.xmin::text,
                       p.fence, p.amount_cents, p.xmin::text
                FROM jobfence_locks l
                JOIN jobfence_jobs j ON j.job_key = l.key
                JOIN jobfence_fences f ON f.resource = 'job:' || l.key
                JOIN payments p ON p.payment_id = %s
                WHERE l.prefix = %s AND l.key = %s
                """,
                (pid, db.prefix, key),
            ).fetchall()
            for pid, key in keys.items()
        }
        ledger_rows = conn.execute(
            "SELECT count(*) FROM payments WHERE payment_id = ANY(%s)", (list(keys),)
        ).fetchone()
    assert ledger_rows == (PAYMENTS,)  # none lost, none twice
    for (pid, _, amount), found in zip(payments, rows.values(), strict=True):
        assert len(found) == 1, (pid, found)
        (owner, rec_state, rec_fence, lock_xmin, job_state, job_fence, result, job_xmin,
         guard_fence, guard_xmin, pay_fence, pay_amount, pay_xmin) = found[0]  # fmt: skip
        assert owner == "" and rec_state == "DONE"  # released, with its record
        assert job_state == "DONE" and json.loads(result)["status"] == "charged"
        # One grant did it all: the lease's fence is on the guard, both records and the row.
        assert rec_fence == job_fence == guard_fence == pay_fence, (pid, found[0])
        assert pay_amount == amount
        # Effect, fence check and DONE row: one transaction. The lease record: another.
        assert pay_xmin == job_xmin == guard_xmin, (pid, found[0])
        assert lock_xmin != pay_xmin
    for account in accounts:
        charged = sum(amount for _, a, amount in payments if a == account)
        assert balance_of(db.engine, account) == OPENING - charged


def test_control_the_seed_articles_advisory_lock_in_the_same_database_charges_again(
    one_db: OneDatabase,
) -> None:
    db = one_db
    accounts, payments = plan("naive")
    for account in accounts:
        open_account(db.engine, account, currency="EUR", balance_cents=OPENING)
    storm(db, NAIVE_CHARGE, payments)
    with db.engine.connect() as conn:
        counts = dict(
            conn.execute(
                sa.text(
                    "SELECT payment_id, count(*) FROM naive_charges WHERE payment_id LIKE :run "
                    "GROUP BY payment_id"
                ),
                {"run": payments[0][0].rsplit("-", 1)[0] + "-%"},
            ).all()
        )
    assert set(counts) == {p for p, _, _ in payments}
    # The copies published after the first run ended found the lock free and charged again
    # (two such copies of one payment at once: the lock stops one of them, not both).
    assert all(n >= 2 for n in counts.values()), counts
    for account in accounts:
        once = sum(amount for _, a, amount in payments if a == account)
        assert balance_of(db.engine, account) < OPENING - once  # charged more than once
