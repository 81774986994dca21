"""A payment storm on real workers across a Sentinel failover that loses what was not replicated.

Real `celery worker` processes run the shipped `tasks.payments.charge` with JOBFENCE_LOCK_URL
a redis+sentinel:// URL. While they charge, the master's replicas are frozen and cut off and
the master is killed: the locks, fences and DONE records written in that window are gone
on the replica the sentinels promote. Each payment is still charged exactly once and none is
lost: jobs whose calls failed are redelivered, their lost DONE records are answered by the
ledger's own row, and the fence on the new master is higher than any the old one issued.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from demo.shop.ledger import balance_of, create_schema, open_account, payments
from demo.shop.payments import CHARGE
from devstack.local_sentinel import LocalSentinel
from jobfence.config import Settings
from jobfence.tasks import runtime_for
from jobfence.tasks.effects import make_engine
from jobfence.worker.app import create_app
from tests.integration.celery_fleet import Fleet, FleetFactory
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase, RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.fault]

APP = "tests.integration.apps.one_database_app"
PAYMENTS = 24
ACCOUNTS = 4
OPENING = 1_000_000  # cents: no charge is declined
SETTLE = 90.0  # seconds a phase may take on a loaded two-core machine


@dataclass
class SentinelFleet:
    fleet: Fleet
    client: Celery
    broker: redis.Redis
    engine: sa.Engine
    topology: LocalSentinel


@pytest.fixture
def sentinel_fleet(
    module_redis: RedisServer, fleet_factory: FleetFactory
) -> Iterator[SentinelFleet]:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    server = f"redis://{module_redis.host}:{module_redis.port}"
    with LocalSentinel() as topology, PostgresDatabase() as db:
        env = {
            "JOBFENCE_LOCK_URL": topology.url,
            "JOBFENCE_DATABASE_URL": db.url,
            "JOBFENCE_BROKER_URL": f"{server}/0",
            "JOBFENCE_RESULT_BACKEND": f"{server}/1",
            "JOBFENCE_REDELIVERY_DELAY": "0.3",
            "JOBFENCE_SOCKET_TIMEOUT": "1.0",
        }
        settings = Settings(lock_url=topology.url, database_url=db.url,
                            broker_url=env["JOBFENCE_BROKER_URL"],
                            result_backend=env["JOBFENCE_RESULT_BACKEND"])  # fmt: skip
        engine = make_engine(db.url)
        create_schema(engine)
        fleet = fleet_factory(APP, env=env, workers=2, concurrency=2)
        client = create_app(settings, include=["demo.shop.payments"])
        broker = redis.Redis.from_url(f"{server}/0")
        try:
            yield SentinelFleet(fleet, client, broker, engine, topology)
        finally:
            fleet.stop()  # before the servers go
            broker.close()
            runtime_for(client).close()
            client.close()
            engine.dispose()


def charged(engine: sa.Engine, run: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).select_from(payments)
            .where(payments.c.payment_id.like(f"{run}-%"))
        ).scalar_one())  # fmt: skip


def test_a_payment_storm_across_a_lossy_failover_charges_each_payment_once(
    sentinel_fleet: SentinelFleet,
) -> None:
    s = sentinel_fleet
    run = f"st-{uuid.uuid4().hex[:6]}"
    accounts = [f"{run}-acct-{i}" for i in range(ACCOUNTS)]
    plan = [(f"{run}-pay-{i:03d}", accounts[i % ACCOUNTS], 100 + i) for i in range(PAYMENTS)]
    for account in accounts:
        open_account(s.engine, account, currency="EUR", balance_cents=OPENING)

    def storm(wave: list[tuple[str, str, int]]) -> None:
        for pid, account, amount in wave:  # two copies of every payment at once
            s.client.send_task(CHARGE, args=[pid, account, amount, "EUR"])
            s.client.send_task(CHARGE, args=[pid, account, amount, "EUR"])

    # Half the storm before the fault, half inside its window: on a loaded machine a whole
    # storm sent first was all charged before the replicas were even frozen.
    first, second = plan[: PAYMENTS // 2], plan[PAYMENTS // 2 :]
    storm(first)
    wait_for(lambda: charged(s.engine, run) >= 3, SETTLE, message=lambda: s.fleet.logs(20))

    def charge_a_few_more() -> int:
        # The window whose lock writes never reach a replica: some charges commit in it.
        start = charged(s.engine, run)
        storm(second)
        wait_for(lambda: charged(s.engine, run) >= min(PAYMENTS, start + 4), SETTLE,
                 message=lambda: s.fleet.logs(20))  # fmt: skip
        return start

    before = s.topology.failover_losing(charge_a_few_more)
    assert before < PAYMENTS, "the storm ended before the failover: it proves nothing"
    s.fleet.wait_idle(s.broker, timeout=SETTLE)
    # The fault hit: payments charged in the window have no DONE record on the new master.
    task, backend = s.client.tasks[CHARGE], runtime_for(s.client).backend
    keys = {pid: task.identity([pid, a, amount, "EUR"], {}, None)[0] for pid, a, amount in plan}
    lost = [pid for pid, key in keys.items() if backend.job_record(key) is None]
    assert lost, "every DONE record survived the failover: the fault never hit"
    for pid, account, amount in plan:  # a late copy of each, after the failover
        s.client.send_task(CHARGE, args=[pid, account, amount, "EUR"])
    s.fleet.wait_idle(s.broker, timeout=SETTLE)

    with s.engine.connect() as conn:
        rows = conn.execute(
            sa.select(payments.c.payment_id, sa.func.count())
            .where(payments.c.payment_id.like(f"{run}-%"))
            .group_by(payments.c.payment_id)
        ).all()  # fmt: skip
    counts = {pid: int(n) for pid, n in rows}
    assert counts == {pid: 1 for pid, _, _ in plan}, counts  # none lost, none twice
    for account in accounts:
        spent = sum(amount for _, a, amount in plan if a == account)
        assert balance_of(s.engine, account) == OPENING - spent
