"""A real Django project (tests/django_project) on PostgreSQL under a real prefork celery worker.

The shop's Celery app is set up the Django way (``config_from_object("django.conf:settings",
namespace="CELERY")``, ``autodiscover_tasks()``); jobfence takes its JOBFENCE_* settings from
settings.py (none is in the worker's environment), and its tables from ``manage.py migrate``.
Storms of duplicate payment messages go to one worker with two pool processes; the broker
redelivers the slow ones while they run. Everything is asserted from the database.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from tests.integration.celery_fleet import Fleet
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase, RedisServer, wait_for

pytest.importorskip("django")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCK_DB, RESULT_DB = 1, 2
# Held 3 s, past the 1 s visibility timeout: two of the first storm, and the frozen holders.
SLOW_PAYMENTS = (3, 17, FROZEN_PAYMENT := 701, FROZEN_PLAIN_PAYMENT := 702)
INITIAL_BALANCE = 1_000_000
COPIES = 5
PAYMENTS = 30
ACCOUNTS = 6


@dataclass
class Shop:
    env: dict[str, str]
    engine: sa.Engine
    broker: redis.Redis
    locks: redis.Redis
    client: Celery
    fleet: Fleet
    hold_dir: Path

    def manage(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tests.django_project.manage", *args],
            env={**os.environ, **self.env},
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def open_accounts(self, first_id: int) -> list[int]:
        ids = list(range(first_id, first_id + ACCOUNTS))
        with self.engine.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO shop_account (id, balance_cents) VALUES (:id, :b)"),
                [{"id": i, "b": INITIAL_BALANCE} for i in ids],
            )
        return ids

    def storm(self, task: str, first_payment: int, accounts: list[int]) -> dict[int, Any]:
        """COPIES messages of each of PAYMENTS payments, shuffled; returns payment -> args."""
        payments = {
            first_payment + n: [first_payment + n, accounts[n % len(accounts)], 100 + n]
            for n in range(PAYMENTS)
        }
        messages = [args for args in payments.values() for _ in range(COPIES)]
        random.Random(first_payment).shuffle(messages)
        self.settle([self.client.send_task(task, args=args).id for args in messages])
        return payments

    def settle(self, task_ids: list[str], timeout: float = 180) -> None:
        """Wait until every message published has run once, then until nothing is left.

        (Idle alone is not enough: between kombu's BRPOP and its unacked bookkeeping a
        message is in neither place, so a fleet that has not started looks idle.)
        """
        wanted = set(task_ids)
        wait_for(
            lambda: wanted <= {e.task_id for e in self.fleet.events() if e.kind == "postrun"},
            timeout,
            0.1,
            message=self.fleet.logs,
        )
        self.fleet.wait_idle(self.broker, timeout=timeout)

    def rows(self, sql: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params))

    def payments_per_id(self, via: str, ids: Any) -> Counter[int]:
        rows = self.rows(
            "SELECT payment_id FROM shop_payment WHERE via = :via AND payment_id = ANY(:ids)",
            via=via,
            ids=list(ids),
        )
        return Counter(int(r[0]) for r in rows)

    def balances(self, accounts: list[int]) -> dict[int, int]:
        rows = self.rows(
            "SELECT id, balance_cents FROM shop_account WHERE id = ANY(:ids)", ids=accounts
        )
        return {int(r[0]): int(r[1]) for r in rows}

    def done_rows(self, ids: Any) -> Counter[int]:
        rows = self.rows("SELECT result FROM jobfence_jobs WHERE state = 'DONE'")
        wanted = set(ids)
        found = (int(json.loads(r[0])["payment_id"]) for r in rows)
        return Counter(p for p in found if p in wanted)

    def payment_rows(self, payment_id: int) -> list[Any]:
        return self.rows(
            "SELECT via, fence, pid FROM shop_payment WHERE payment_id = :p ORDER BY id",
            p=payment_id,
        )

    def holders(self, payment_id: int) -> list[int]:
        """Pids of the pool processes that reached the hold of ``payment_id``, in no order."""
        return [int(p.suffix[1:]) for p in self.hold_dir.glob(f"{payment_id}.*")]

    def freeze_holder_until_charged(self, task: str, payment_id: int, account: int) -> int:
        """Publish once; SIGSTOP the process holding the payment until another has charged
        it (the broker redelivers after the visibility timeout); resume; return its pid."""
        task_id = self.client.send_task(task, args=[payment_id, account, 300]).id
        [frozen] = wait_for(
            lambda: self.holders(payment_id), 60, 0.02, message=self.fleet.logs
        )
        with self.fleet.paused(frozen):
            wait_for(
                lambda: self.payment_rows(payment_id),
                60,
                0.1,
                message=lambda: f"nobody took over payment {payment_id}\n" + self.fleet.logs(),
            )
        self.settle([task_id], timeout=60)
        return frozen

    def fence(self, payment_id: int) -> int:
        [(value,)] = self.rows(
            "SELECT fence FROM jobfence_fences WHERE resource = :r", r=f"payment:{payment_id}"
        )
        return int(value)


def expected_balances(payments: dict[int, Any], accounts: list[int]) -> dict[int, int]:
    out = dict.fromkeys(accounts, INITIAL_BALANCE)
    for _, account, amount in payments.values():
        out[account] -= amount
    return out


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    leaked = [k for k in os.environ if k.startswith("JOBFENCE_")]
    saved = {k: os.environ.pop(k) for k in leaked}  # settings.py alone configures jobfence
    hold_dir = tmp_path_factory.mktemp("holds")
    with PostgresDatabase() as db, RedisServer() as server:
        env = {
            "DJANGO_SETTINGS_MODULE": "tests.django_project.settings",
            "SHOP_DB_NAME": db.name,
            "SHOP_BROKER_URL": server.url,
            "SHOP_LOCK_URL": server.db_url(LOCK_DB),
            "SHOP_RESULT_BACKEND": server.db_url(RESULT_DB),
            "SHOP_SLOW_PAYMENTS": ",".join(str(p) for p in SLOW_PAYMENTS),
            "SHOP_SLOW_SECONDS": "3",
            "SHOP_HOLD_DIR": str(hold_dir),
            "VISIBILITY_TIMEOUT": "1.0",
            "UNACKED_RESTORE_INTERVAL": "0.5",
        }
        engine = db.engine()
        client = Celery("shop-client", broker=server.url, backend=server.db_url(RESULT_DB))
        client.conf.update(task_serializer="json", accept_content=["json"])
        fleet = Fleet(
            "tests.django_project",
            workers=1,
            concurrency=2,
            env=env,
            base_dir=tmp_path_factory.mktemp("django-fleet"),
            ready_timeout=60,
        )
        shop = Shop(
            env, engine, server.client(), server.client(db=LOCK_DB), client, fleet, hold_dir
        )
        migrated = shop.manage("migrate", "--noinput")
        assert migrated.returncode == 0, migrated.stderr
        try:
            fleet.start()
            yield shop
        finally:
            fleet.stop()
            client.close()
            engine.dispose()
            os.environ.update(saved)


def test_migrate_creates_the_tables_and_leaves_no_model_change(shop: Shop) -> None:
    tables = {r[0] for r in shop.rows("SELECT tablename FROM pg_tables")}
    assert {"jobfence_fences", "jobfence_jobs", "shop_payment", "shop_account"} <= tables
    check = shop.manage("makemigrations", "--check", "--dry-run")
    assert check.returncode == 0, check.stdout + check.stderr
    system = shop.manage("check")
    assert system.returncode == 0, system.stdout + system.stderr


def test_storm_of_duplicate_payments_charges_each_once(shop: Shop) -> None:
    accounts = shop.open_accounts(1)
    payments = shop.storm("shop.charge", 1, accounts)

    assert shop.payments_per_id("jobfence", payments) == Counter(dict.fromkeys(payments, 1))
    assert shop.done_rows(payments) == Counter(dict.fromkeys(payments, 1))
    assert shop.balances(accounts) == expected_balances(payments, accounts)
    runs = Counter(e.task_id for e in shop.fleet.events() if e.kind == "prerun")
    assert sum(runs.values()) >= PAYMENTS * COPIES
    assert max(runs.values()) > 1, "no message was redelivered: the storm proves less"


def test_lost_lock_data_replays_from_the_django_done_row(shop: Shop) -> None:
    """The lock server forgets every lease and DONE record: the database still answers."""
    accounts = shop.open_accounts(501)
    payments = shop.storm("shop.charge", 501, accounts)
    before = {p: shop.fence(p) for p in payments}
    shop.locks.flushdb()
    shop.settle([shop.client.send_task("shop.charge", args=args).id for args in payments.values()])

    after = {p: shop.fence(p) for p in payments}
    assert all(after[p] > before[p] for p in payments), "the bodies did not run again"
    assert shop.payments_per_id("jobfence", payments) == Counter(dict.fromkeys(payments, 1))
    assert shop.done_rows(payments) == Counter(dict.fromkeys(payments, 1))
    assert shop.balances(accounts) == expected_balances(payments, accounts)


def test_stale_fence_write_is_refused_and_rolled_back(shop: Shop) -> None:
    [account] = shop.open_accounts(901)[:1]
    shop.settle([shop.client.send_task("shop.charge", args=[901, account, 250]).id])
    fence = shop.fence(901)

    stale = shop.client.send_task("shop.fenced_write", args=[901, account, 500, fence - 1])
    assert stale.get(timeout=60) == "stale"
    assert shop.payments_per_id("fenced", [901]) == Counter()
    assert shop.balances([account]) == {account: INITIAL_BALANCE - 250}
    assert shop.fence(901) == fence

    current = shop.client.send_task("shop.fenced_write", args=[901, account, 500, fence])
    assert current.get(timeout=60) == "written"  # the same write with the current token
    assert shop.payments_per_id("fenced", [901]) == Counter({901: 1})
    assert shop.balances([account]) == {account: INITIAL_BALANCE - 750}


def test_frozen_holder_is_fenced_off_after_a_newer_holder_charged(shop: Shop) -> None:
    """SIGSTOP past the lease: a newer holder charges; the old one wakes and is refused."""
    [account] = shop.open_accounts(701)[:1]
    frozen = shop.freeze_holder_until_charged("shop.charge", FROZEN_PAYMENT, account)

    [(via, fence, pid)] = shop.payment_rows(FROZEN_PAYMENT)
    assert (via, pid != frozen) == ("jobfence", True)
    assert shop.fence(FROZEN_PAYMENT) == fence  # the stale token advanced nothing
    assert shop.done_rows([FROZEN_PAYMENT]) == Counter({FROZEN_PAYMENT: 1})
    assert shop.balances([account]) == {account: INITIAL_BALANCE - 300}


def test_control_a_frozen_plain_task_charges_twice(shop: Shop) -> None:
    [account] = shop.open_accounts(801)[:1]
    frozen = shop.freeze_holder_until_charged(
        "shop.charge_plain", FROZEN_PLAIN_PAYMENT, account
    )
    wait_for(lambda: len(shop.payment_rows(FROZEN_PLAIN_PAYMENT)) >= 2, 30, 0.1)
    pids = [pid for _, _, pid in shop.payment_rows(FROZEN_PLAIN_PAYMENT)]
    assert frozen in pids and len(pids) >= 2
    assert shop.balances([account])[account] <= INITIAL_BALANCE - 600


def test_control_the_same_storm_through_a_plain_shared_task_charges_twice(shop: Shop) -> None:
    accounts = shop.open_accounts(2001)
    payments = shop.storm("shop.charge_plain", 2001, accounts)

    charged = shop.payments_per_id("plain", payments)
    assert all(charged[p] >= 2 for p in payments), charged
    assert sum(charged.values()) >= PAYMENTS * COPIES
    assert shop.balances(accounts) != expected_balances(payments, accounts)
