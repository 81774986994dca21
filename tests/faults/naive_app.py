"""The fault rows' naive controls: plain Celery tasks as the blog posts write them, no jobfence.

``celery -A tests.faults.naive_app worker`` finds ``app``, built from the environment on first
access (the variables of :mod:`tests.integration.apps.common`, plus ``LOCK_URL``, the Redis
server of the naive locks, and ``DATABASE_URL``, the SQL ledger the charges write). Each task
is what an experienced user writes without jobfence for the fault at hand:

``naive.charge``
    acks_late + reject_on_worker_lost (Celery's "reliable" settings), no lock: debit the
    account and insert a charge row.
``naive.charge_once``
    the same, deduplicated by a plain Redis lock kept as the "already charged" marker:
    ``SET naive:pay:<id> NX EX 3600`` first, skip the charge if it is taken.
``naive.charge_locked``
    Celery's defaults (acks early), a plain Redis lock held around the charge
    (``SET NX EX``, ``DEL`` in ``finally``).
``naive.poison``
    acks_late + reject_on_worker_lost; counts its delivery, then kills its own process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery, Task

from demo.shop.ledger import accounts
from jobfence.tasks.effects import make_engine
from tests.faults import hold
from tests.integration.apps.common import app_on_first_access, make_app

__all__ = ["charges", "create_app", "create_schema", "deliveries_key", "metadata"]

metadata = sa.MetaData()
#: One row per naive charge that went through: a payment id twice is a double charge.
charges = sa.Table(
    "naive_charges",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("payment_id", sa.String(64), nullable=False, index=True),
    sa.Column("account", sa.String(64), nullable=False),
    sa.Column("amount_cents", sa.BigInteger, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("t", sa.Float, nullable=False),
)
LOCK_TTL = 3600


def create_schema(engine: sa.Engine) -> None:
    metadata.create_all(engine)


def deliveries_key(job_id: str) -> str:
    """The Redis counter of a poison job's deliveries (on the ledger server)."""
    return f"naive:deliveries:{job_id}"


class _Process:
    """This process's SQL engine and Redis clients, made after fork (never shared)."""

    def __init__(self) -> None:
        self.pid = -1
        self._engine: sa.Engine | None = None
        self._locks: redis.Redis | None = None
        self._ledger: redis.Redis | None = None

    def _fresh(self) -> None:
        if self.pid != os.getpid():
            self.pid, self._engine, self._locks, self._ledger = os.getpid(), None, None, None

    @property
    def engine(self) -> sa.Engine:
        self._fresh()
        if self._engine is None:
            self._engine = make_engine(os.environ["DATABASE_URL"])
        return self._engine

    @property
    def locks(self) -> redis.Redis:
        self._fresh()
        if self._locks is None:
            url = os.environ.get("LOCK_URL") or os.environ["BROKER_URL"]
            self._locks = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        return self._locks

    @property
    def ledger(self) -> redis.Redis:
        self._fresh()
        if self._ledger is None:
            url = os.environ.get("LEDGER_URL") or os.environ["BROKER_URL"]
            self._ledger = redis.Redis.from_url(url, socket_timeout=5.0)
        return self._ledger


_proc = _Process()


def _pause() -> None:
    """The body's work before its effect (JOBFENCE_DEMO_DELAY_MAX_MS, as the shop tasks)."""
    delay = float(os.environ.get("JOBFENCE_DEMO_DELAY_MAX_MS") or 0)
    if delay > 0:
        time.sleep(delay / 1000)


def _charge(payment_id: str, account: str, amount_cents: int) -> dict[str, Any]:
    with _proc.engine.begin() as conn:
        conn.execute(
            sa.update(accounts)
            .where(accounts.c.account == account)
            .values(balance_cents=accounts.c.balance_cents - amount_cents)
        )
        conn.execute(
            charges.insert().values(
                payment_id=payment_id,
                account=account,
                amount_cents=amount_cents,
                pid=os.getpid(),
                t=time.time(),
            )
        )
    return {"status": "charged", "payment_id": payment_id}


def charge(self: Task, payment_id: str, account: str, amount_cents: int, currency: str) -> Any:
    _pause()
    return _charge(payment_id, account, amount_cents)


def charge_once(self: Task, payment_id: str, account: str, amount_cents: int, currency: str) -> Any:
    if not _proc.locks.set(f"naive:pay:{payment_id}", self.request.id, nx=True, ex=LOCK_TTL):
        return {"status": "duplicate", "payment_id": payment_id}
    _pause()
    return _charge(payment_id, account, amount_cents)


def charge_locked(
    self: Task, payment_id: str, account: str, amount_cents: int, currency: str
) -> Any:
    lock = f"naive:lock:{payment_id}"
    if not _proc.locks.set(lock, self.request.id, nx=True, ex=30):
        return {"status": "duplicate", "payment_id": payment_id}
    try:
        _pause()
        return _charge(payment_id, account, amount_cents)
    finally:
        _proc.locks.delete(lock)


def poison(self: Task, job_id: str) -> None:
    _proc.ledger.incr(deliveries_key(job_id))
    os._exit(1)  # the message that kills its worker: a segfaulting C library, an OOM kill


def create_app(env: Mapping[str, str], name: str = "naive_app") -> Celery:
    """The Celery app with every ``naive.*`` task registered."""
    app = make_app(name, env)
    reliable = {"bind": True, "acks_late": True, "reject_on_worker_lost": True}
    app.task(name="naive.charge", **reliable)(charge)
    app.task(name="naive.charge_once", **reliable)(charge_once)
    app.task(name="naive.charge_locked", bind=True, acks_late=False)(charge_locked)
    app.task(name="naive.poison", **reliable)(poison)
    hold.connect()
    return app


__getattr__ = app_on_first_access(__name__, create_app)
