"""What every fault row needs on one side: its own servers, a real fleet, a payment storm, a tally.

A :class:`Rig` owns a private broker redis-server (optionally persistent, AOF on), a separate
private lock redis-server (restarting it loses every lock, fence and record), an SQLite ledger
with one well-funded account, and the worker fleets started on them. The naive side runs
``tests.faults.naive_app``; the jobfence side runs ``tests.faults.fenced_app`` (the demo
shop's app and its start-up checks) with the shop's payment task. Both sides are judged on
the SQL ledger alone: a payment id charged twice is a double effect, a published payment with no
charge at the end is a lost job, and the account's balance must match its charges.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis
import sqlalchemy as sa
from celery import Celery

from demo.shop.ledger import accounts, create_schema, open_account, payments
from devstack.faults_report import Outcome, Side
from devstack.redis_server import RedisServer, free_port
from jobfence.tasks.effects import make_engine
from tests.faults import naive_app
from tests.integration.celery_fleet import Fleet, broker_backlog
from tests.servers import wait_for

ACCOUNT = "acct-faults"
OPENING = 10**12
CURRENCY = "EUR"
CHARGE = "tasks.payments.charge"  # the shipped payment workflow
LEASE_TTL = 2.0
VISIBILITY_TIMEOUT = 4.0
NAIVE_APP = "tests.faults.naive_app"
FENCED_APP = "tests.faults.fenced_app"
#: Redis databases: broker 0, results 1, ledger (delivery counters) 2 on the broker server;
#: locks 0 and the hold flag (tests.faults.hold) 3 on the lock server.
RESULTS_DB = 1
LEDGER_DB = 2
HOLD_DB = 3


@dataclass(frozen=True)
class Payment:
    payment_id: str
    amount_cents: int

    def args(self) -> list[Any]:
        return [self.payment_id, ACCOUNT, self.amount_cents, CURRENCY]


def plan_payments(prefix: str, count: int) -> list[Payment]:
    return [Payment(f"{prefix}-{i:04d}", 100 + (i * 37) % 900) for i in range(count)]


@dataclass
class Rig:
    """One side of one fault row: servers, ledger, fleets; stopped (and reaped) on exit."""

    side: Side
    workdir: Path
    persistent_broker: bool = False
    start_locks: bool = True
    body_ms: float = 300.0  # the body's work before its effect
    hold_acks: bool = False  # connect tests.faults.hold: bodies wait before their ack on a flag
    env_extra: dict[str, str] = field(default_factory=dict)
    fleets: list[Fleet] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent_broker else []
        self.broker = RedisServer(workdir=self.workdir / "broker", extra_args=aof)
        # The port is fixed now, so workers can be pointed at a lock server not yet started.
        self.locks = RedisServer(port=free_port(), workdir=self.workdir / "locks")
        self.database_url = f"sqlite:///{self.workdir / 'ledger.sqlite'}"
        self.engine: sa.Engine | None = None
        self._clients: list[redis.Redis] = []
        self._publisher: Celery | None = None

    # -- life cycle -------------------------------------------------------------------
    def __enter__(self) -> Self:
        try:
            self.broker.start()
            if self.start_locks:
                self.locks.start()
            self.engine = make_engine(self.database_url)
            create_schema(self.engine)
            naive_app.create_schema(self.engine)
            open_account(self.engine, ACCOUNT, currency=CURRENCY, balance_cents=OPENING)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for fleet in reversed(self.fleets):
            with contextlib.suppress(Exception):
                fleet.stop(timeout=5.0)
        if self._publisher is not None:
            self._publisher.close()
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        if self.engine is not None:
            self.engine.dispose()
        self.locks.stop()
        self.broker.stop()

    # -- configuration ----------------------------------------------------------------
    @property
    def lock_url(self) -> str:
        return self.locks.db_url(0)

    @property
    def app_module(self) -> str:
        return NAIVE_APP if self.side == "naive" else FENCED_APP

    def env(self) -> dict[str, str]:
        """Both apps' variables: the naive app reads the plain ones, jobfence JOBFENCE_*."""
        delay = str(int(self.body_ms))
        return {
            "BROKER_URL": self.broker.url,
            "LOCK_URL": self.lock_url,
            "LEDGER_URL": self.broker.db_url(LEDGER_DB),
            "DATABASE_URL": self.database_url,
            "VISIBILITY_TIMEOUT": repr(VISIBILITY_TIMEOUT),
            "JOBFENCE_BROKER_URL": self.broker.url,
            "JOBFENCE_RESULT_BACKEND": self.broker.db_url(RESULTS_DB),
            "JOBFENCE_LOCK_URL": self.lock_url,
            "JOBFENCE_DATABASE_URL": self.database_url,
            "JOBFENCE_DEFAULT_TTL": repr(LEASE_TTL),
            "JOBFENCE_SOCKET_TIMEOUT": "0.5",
            "JOBFENCE_VISIBILITY_TIMEOUT": repr(VISIBILITY_TIMEOUT),
            "JOBFENCE_KEY_SECRET": secrets.token_hex(16),
            "JOBFENCE_DEMO_DELAY_MIN_MS": delay,
            "JOBFENCE_DEMO_DELAY_MAX_MS": delay,
            **({"HOLD_URL": self.locks.db_url(HOLD_DB)} if self.hold_acks else {}),
            **self.env_extra,
        }

    def fleet(self, *, workers: int = 2, concurrency: int = 2, prefetch: int = 1) -> Fleet:
        """Start a fleet of this side's app on the rig (the lock server may be down)."""
        extra = [f"--prefetch-multiplier={prefetch}"] if prefetch != 1 else []
        fleet = Fleet(
            self.app_module,
            workers=workers,
            concurrency=concurrency,
            env=self.env(),
            base_dir=self.workdir / f"fleet-{len(self.fleets)}",
            ready_timeout=60.0,
            extra_args=extra,
        )
        self.fleets.append(fleet)
        return fleet.start()

    def client(self, server: RedisServer, db: int = 0) -> redis.Redis:
        client = server.client(db=db, socket_timeout=5.0)
        self._clients.append(client)
        return client

    # -- publishing -------------------------------------------------------------------
    def publisher(self) -> Celery:
        if self._publisher is None:
            app = Celery("faults-publisher", broker=self.broker.url, set_as_current=False)
            app.conf.update(task_serializer="json", accept_content=["json"])
            self._publisher = app
        return self._publisher

    def send(self, task: str, args: Sequence[Any]) -> str:
        return str(self.publisher().send_task(task, args=list(args)).id)

    def charge_task(self, naive: str) -> str:
        return naive if self.side == "naive" else CHARGE

    def publish(self, task: str, batch: Sequence[Payment]) -> None:
        with self.publisher().producer_or_acquire() as producer:
            for p in batch:
                self.publisher().send_task(task, args=p.args(), producer=producer)

    # -- looking ----------------------------------------------------------------------
    def charges(self) -> Counter[str]:
        """Effects per payment id in the ledger (the shipped table, or the naive one)."""
        assert self.engine is not None
        table = naive_app.charges if self.side == "naive" else payments
        with self.engine.connect() as conn:
            return Counter(r.payment_id for r in conn.execute(sa.select(table.c.payment_id)))

    def balance_error(self) -> int:
        """Cents debited beyond the charges on record (a hidden double debit), or 0."""
        assert self.engine is not None
        table = naive_app.charges if self.side == "naive" else payments
        with self.engine.connect() as conn:
            charged = conn.execute(sa.select(sa.func.sum(table.c.amount_cents))).scalar() or 0
            balance = conn.execute(
                sa.select(accounts.c.balance_cents).where(accounts.c.account == ACCOUNT)
            ).scalar_one()
        return int(OPENING - charged - balance)

    def done(self, planned: Sequence[Payment]) -> int:
        got = self.charges()
        return sum(1 for p in planned if got[p.payment_id])

    def idle(self, fleet: Fleet) -> bool:
        """Nothing queued, delivered-unacked or scheduled on the broker, nothing executing."""
        try:
            backlog = broker_backlog(self.client(self.broker))
        except redis.RedisError:
            return False
        return not backlog and not fleet.executing_pids()

    def settle(
        self,
        fleet: Fleet,
        planned: Sequence[Payment],
        timeout: float,
        quiet: float = 2.0,
    ) -> None:
        """Wait until every payment has a charge and the fleet stays idle for ``quiet`` s,
        or until the fleet is idle that long with charges missing (they are lost), or until
        ``timeout`` (whatever is missing then counts as lost too)."""
        deadline = time.monotonic() + timeout
        idle_since: float | None = None
        while time.monotonic() < deadline:
            if self.idle(fleet):
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= quiet:
                    return
            else:
                idle_since = None
            time.sleep(0.1)

    def tally(self, planned: Sequence[Payment], detail: str = "") -> Outcome:
        got = self.charges()
        double = sum(1 for p in planned if got[p.payment_id] > 1)
        lost = sum(1 for p in planned if not got[p.payment_id])
        off = self.balance_error()
        notes = [detail] if detail else []
        if off:
            notes.append(f"balance off by {off} cents")
        return Outcome(
            jobs=len(planned),
            double=double,
            lost=lost,
            detail="; ".join(notes),
            broken=True if off else None,
        )


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until truthy; raise TimeoutError naming ``what`` after ``timeout``."""
    return wait_for(
        predicate, timeout, interval=0.05, message=f"waiting for {what}", error=TimeoutError
    )
