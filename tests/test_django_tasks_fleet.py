"""Django's tasks framework on real Celery workers: a duplicate storm of one `@task` charges
each invoice once behind FencedBackend, and more than once on the bare backend (the control).

The project (tests/djtasks_project) enqueues with `task.enqueue()` (Django 6's django.tasks
on 3.12 and 3.13, the backport on 3.11: tests/test_django_tasks_path.py) from three
processes side by side;
three prefork workers run the carrier; each charge outlasts the broker's 1 s visibility
timeout, so running messages are redelivered too. Counted in PostgreSQL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from tests.integration.celery_fleet import Fleet
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase, RedisServer, wait_for

pytest.importorskip("django")
pytest.importorskip(
    "jobfence.tasks.django_tasks", reason="needs django.tasks (Django 6) or the backport"
)
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCK_DB = 1
INVOICES = 4
COPIES = 50
PUBLISHERS = 3  # processes enqueueing the storm side by side


@dataclass
class Billing:
    env: dict[str, str]
    engine: sa.Engine
    broker: redis.Redis
    fleet: Fleet

    def storm(
        self, task: str, first_invoice: int, invoices: int = INVOICES, copies: int = COPIES,
        *, crash: bool = False,
    ) -> list[int]:
        """`copies` enqueues of each of `invoices` charges, shuffled, from PUBLISHERS processes
        side by side (as web processes would), a share each; waits until all ran. `crash`:
        a pool process is SIGKILLed mid-delivery during the storm, so its message comes back
        (Celery requeues it: acks_late, reject_on_worker_lost)."""  # fmt: skip
        shares = [copies // PUBLISHERS + (i < copies % PUBLISHERS) for i in range(PUBLISHERS)]
        args = [sys.executable, "-m", "tests.djtasks_project.storm", task, str(first_invoice),
                str(invoices)]  # fmt: skip
        env = {**os.environ, **self.env}
        publishers = [
            subprocess.Popen([*args, str(share), str(seed)], env=env, cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for seed, share in enumerate(shares)
        ]  # fmt: skip
        if crash:  # the first pool process seen running a delivery, while the storm goes on
            busy = wait_for(self.fleet.executing_pids, 60, 0.01, message=self.fleet.logs)
            self.fleet.kill_child(busy[0])
        ids: set[str] = set()
        for publisher in publishers:
            out, err = publisher.communicate(timeout=120)
            assert publisher.returncode == 0, err
            ids |= set(json.loads(out))
        assert len(ids) == invoices * copies
        wait_for(
            lambda: ids <= {e.task_id for e in self.fleet.events() if e.kind == "postrun"},
            240,
            0.2,
            message=self.fleet.logs,
        )
        self.fleet.wait_idle(self.broker, timeout=240)
        return list(range(first_invoice, first_invoice + invoices))

    def charges(self, via: str, invoices: list[int]) -> Counter[int]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT invoice_id FROM billing_charge WHERE via = :via "
                        "AND invoice_id = ANY(:ids)"),
                {"via": via, "ids": invoices},
            )  # fmt: skip
            return Counter(int(r[0]) for r in rows)

    def fences(self, invoices: list[int]) -> list[int]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT fence FROM billing_charge WHERE invoice_id = ANY(:ids)"),
                {"ids": invoices},
            )
            return [int(r[0]) for r in rows]


@pytest.fixture(scope="module")
def billing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Billing]:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    leaked = [k for k in os.environ if k.startswith("JOBFENCE_")]
    saved = {k: os.environ.pop(k) for k in leaked}  # settings.py alone configures jobfence
    with PostgresDatabase() as db, RedisServer() as server:
        env = {
            "DJANGO_SETTINGS_MODULE": "tests.djtasks_project.settings",
            "BILLING_DB_NAME": db.name,
            "BILLING_BROKER_URL": server.url,
            "BILLING_LOCK_URL": server.db_url(LOCK_DB),
            "BILLING_SLOW_SECONDS": "1.2",
            "VISIBILITY_TIMEOUT": "1.0",
            "UNACKED_RESTORE_INTERVAL": "0.5",
        }
        engine = db.engine()
        with engine.begin() as conn:
            conn.execute(sa.text(
                "CREATE TABLE billing_charge (id serial PRIMARY KEY, invoice_id int NOT NULL, "
                "amount int NOT NULL, via text NOT NULL, fence bigint, pid int NOT NULL)"
            ))  # fmt: skip
        fleet = Fleet(
            "tests.djtasks_project",
            workers=3,
            concurrency=2,
            env=env,
            base_dir=tmp_path_factory.mktemp("djtasks-fleet"),
            ready_timeout=60,
        )
        try:
            fleet.start()
            yield Billing(env, engine, server.client(), fleet)
        finally:
            fleet.stop()
            engine.dispose()
            os.environ.update(saved)


def test_a_storm_of_one_django_task_charges_each_invoice_once(billing: Billing) -> None:
    invoices = billing.storm("charge", 1, crash=True)

    assert billing.charges("jobfence", invoices) == Counter(dict.fromkeys(invoices, 1))
    assert all(f > 0 for f in billing.fences(invoices))
    runs = Counter(e.task_id for e in billing.fleet.events() if e.kind == "prerun")
    print(f"deliveries: {sum(runs.values())} of {len(runs)} messages")
    # The crashed body's message came back (jobfence's custody no longer puts back a slow
    # holder's message after the visibility timeout, so without the crash none may).
    assert max(runs.values()) > 1, "no message came back (redelivery or retry): proves less"


def test_without_the_gate_the_same_storm_charges_more_than_once(billing: Billing) -> None:
    # 2 x 10 slow runs are enough: without the gate every copy charges (the storm's 2 x 50 gave
    # 269 charges, redeliveries included), so any count above 1 shows it.
    invoices = billing.storm("charge_plain", 101, invoices=2, copies=10)

    charged = billing.charges("plain", invoices)
    assert set(charged) == set(invoices)
    print(f"control: {sum(charged.values())} charges for {len(invoices)} invoices")
    assert max(charged.values()) > 1, charged
