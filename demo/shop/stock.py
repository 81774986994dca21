"""Stock: reserve(order_id, sku, qty) never oversells; reconcile_stock() checks it per slot.

How the shared sku row is protected (and why not with a fence on "sku:{sku}")
------------------------------------------------------------------------------
A fencing token is only comparable with other grants of the *same* lease key. reserve is
keyed by order_id, so each order's lease comes from its own counter. On Redis the token
is max(last + 1, server time in µs), which makes tokens of different keys roughly ordered
by acquisition time, and that is exactly the trap: order A acquires (fence 100), order B
acquires (fence 101), B commits first and raises "sku:X" to 101, then A, a perfectly live
holder, is refused with StaleFence and its reservation is dropped as "superseded". Two
designs avoid the trap:

1. A short per-sku lease inside the task, whose fence (one counter per sku, so
   comparable) guards "sku:{sku}". Correct, but it costs another lock round trip per
   order, queues every order of a hot sku on the lock server for a network round trip
   instead of a short row lock, and adds a second lease that can be lost on its own;
   that loss is not "this job was superseded", so it would need its own retry path.
2. (chosen) Let the database arbitrate the shared row. The stock row is read with
   SELECT ... FOR UPDATE (PostgreSQL/MySQL row lock; on SQLite the transaction is BEGIN
   IMMEDIATE, so writers are serialised already), and decremented with a conditional
   UPDATE ... SET quantity = quantity - qty WHERE quantity >= qty, under a CHECK
   (quantity >= 0). No interleaving of live or zombie workers can oversell: the
   check and the write are one atomic step in the store itself, even where FOR UPDATE
   is a no-op.

What a fence is for is to stop a stale holder of *the same job* from writing after a
newer one. Here every job's effect on a shared row is a delta that commutes with other
jobs' deltas, so ordering between different orders is not needed, only once-ness per
order. That is given by three things in one transaction: the fence on the job's own
resource ("job:<lease key>", whose grants are strictly increasing: a zombie that comes
back after the newer holder wrote gets StaleFence and writes nothing), the DONE row keyed
by the job key (a newer holder that runs after a zombie's write finds it and replays the
stored result), and the reservations primary key on order_id (the business record,
which also holds when a caller picks an explicit idempotency key). Payments on a shared
account use the same design.

A refused order (unknown sku, not enough stock) is a result, not an error: it is stored
with the DONE row, so a duplicate of the order gets the same refusal.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError

from demo.shop.faults import TransientError, faults_for
from demo.shop.ledger import (
    QTY_MAX,
    InvalidInput,
    check_id,
    check_positive_int,
    insert_effect,
    job_resource,
    now,
    reservations,
    stock,
    stock_reconciliations,
)
from jobfence.tasks.celery_task import HEADER, SingletonTask, singleton_task
from jobfence.tasks.context import JobContext
from jobfence.tasks.effects import SqlEffects
from jobfence.tasks.errors import IdempotencyConflict
from jobfence.tasks.keys import canonical_json
from jobfence.tasks.runtime import runtime_for

log = logging.getLogger(__name__)

RESERVE = "tasks.stock.reserve"
RECONCILE = "tasks.stock.reconcile_stock"


def check_reservation(order_id: Any, sku: Any, qty: Any) -> None:
    """Raise InvalidInput naming the first unusable argument."""
    check_id("order_id", order_id)
    check_id("sku", sku)
    check_positive_int("qty", qty, QTY_MAX)


def apply_reservation(
    effects: SqlEffects, job: JobContext, order_id: str, sku: str, qty: int
) -> dict[str, Any]:
    """Reserve `qty` of `sku` for `order_id`, or refuse; the answer is stored as DONE.

    Raises StaleFence if a newer holder of this order's job wrote first, and
    IdempotencyConflict if the order was reserved with another sku or quantity.
    """
    check_reservation(order_id, sku, qty)
    terms = {"order_id": order_id, "sku": sku, "qty": qty}
    with effects.transaction(job, job_resource(job)) as tx:
        if tx.done:
            return dict(tx.result)
        conn = tx.conn
        row = conn.execute(
            select(reservations.c.sku, reservations.c.qty, reservations.c.fence).where(
                reservations.c.order_id == order_id
            )
        ).first()
        if row is not None:  # reserved under another job key (an explicit idempotency key)
            if (row.sku, row.qty) != (sku, qty):
                raise IdempotencyConflict(
                    f"order {order_id!r} already reserved {row.qty} of {row.sku!r}; "
                    "nothing changed",
                    key=job.key,
                    fence=job.fence,
                )
            tx.result = {"status": "reserved", **terms, "fence": int(row.fence)}
            return dict(tx.result)
        level = conn.execute(
            select(stock.c.quantity).where(stock.c.sku == sku).with_for_update()
        ).scalar_one_or_none()
        if level is None:
            tx.result = {"status": "refused", "reason": "unknown sku", **terms, "available": 0}
        elif level < qty:
            tx.result = {
                "status": "refused",
                "reason": "insufficient stock",
                **terms,
                "available": int(level),
            }
        else:
            taken = conn.execute(
                update(stock)
                .where(stock.c.sku == sku, stock.c.quantity >= qty)
                .values(quantity=stock.c.quantity - qty, updated_at=now())
            ).rowcount
            if taken != 1:  # cannot happen under the row lock; refuse rather than guess
                raise RuntimeError(f"stock of {sku!r} changed under its row lock")
            insert_effect(
                conn,
                reservations.insert().values(**terms, fence=job.fence, created_at=now()),
                job,
                f"order {order_id!r} is being reserved",
            )
            tx.result = {
                "status": "reserved",
                **terms,
                "remaining": int(level) - qty,
                "fence": job.fence,
            }
    return dict(tx.result)


@singleton_task(
    bind=True,
    name=RESERVE,
    key=["order_id"],
    autoretry_for=(TransientError, OperationalError),
    retry_backoff=True,
    retry_backoff_max=10,
    retry_jitter=True,
    max_retries=5,
)
def reserve(self: SingletonTask, order_id: str, sku: str, qty: int) -> dict[str, Any]:
    """Reserve `qty` units of `sku` for `order_id`, once; refusals are results, not errors.

    Returns {"status": "reserved", ..., "remaining": n} or {"status": "refused",
    "reason": "insufficient stock" | "unknown sku", ..., "available": n}.
    """
    check_reservation(order_id, sku, qty)
    faults_for(self.app).inject("order", order_id, self.request.retries or 0)
    return apply_reservation(runtime_for(self.app).effects, self.job, order_id, sku, qty)


# -- nightly reconciliation --------------------------------------------------------------


def apply_reconciliation(effects: SqlEffects, job: JobContext) -> dict[str, Any]:
    """Compare each sku's on-hand quantity with received - reserved; store the report once."""
    with effects.transaction(job, job_resource(job)) as tx:
        if tx.done:
            return dict(tx.result)
        reserved = (
            select(reservations.c.sku, func.sum(reservations.c.qty).label("reserved"))
            .group_by(reservations.c.sku)
            .subquery()
        )
        # One statement: one snapshot, even under READ COMMITTED.
        rows = tx.conn.execute(
            select(
                stock.c.sku,
                stock.c.received,
                stock.c.quantity,
                func.coalesce(reserved.c.reserved, 0).label("reserved"),
            )
            .select_from(stock.outerjoin(reserved, reserved.c.sku == stock.c.sku))
            .order_by(stock.c.sku)
        ).all()
        mismatches = []
        for r in rows:
            expected = int(r.received) - int(r.reserved)
            if int(r.quantity) != expected:
                mismatches.append(
                    {
                        "sku": r.sku,
                        "on_hand": int(r.quantity),
                        "expected": expected,
                        "received": int(r.received),
                        "reserved": int(r.reserved),
                    }
                )
                log.warning(
                    "stock mismatch sku=%s on_hand=%s expected=%s", r.sku, r.quantity, expected
                )
        report = {
            "status": "ok" if not mismatches else "mismatch",
            "skus_checked": len(rows),
            "mismatches": mismatches,
            "fence": job.fence,
        }
        tx.conn.execute(
            stock_reconciliations.insert().values(
                job_key=job.key,
                skus_checked=len(rows),
                mismatches=len(mismatches),
                report=canonical_json(report),
                fence=job.fence,
                checked_at=now(),
            )
        )
        tx.result = report
    return dict(tx.result)


def _explicit_key(request: Any) -> str | None:
    headers = getattr(request, "headers", None) or {}
    value = headers.get(HEADER) or getattr(request, HEADER, None)
    return value if isinstance(value, str) and value else None


@singleton_task(bind=True, name=RECONCILE)
def reconcile_stock(self: SingletonTask) -> dict[str, Any]:
    """Nightly stock check, once per scheduled slot.

    The slot is the job's explicit idempotency key (the beat scheduler sends it in the
    jobfence_idempotency_key header; by hand: apply_async(idempotency_key="reconcile:
    2024-06-01")). Without one every run would share a single key and replay the first
    report forever, so it is refused.
    """
    if _explicit_key(self.request) is None:
        raise InvalidInput(
            "idempotency_key",
            "reconcile_stock runs once per scheduled slot and needs the slot as its key: "
            'publish it with apply_async(idempotency_key="<entry>@<slot>") or from beat',
        )
    return apply_reconciliation(runtime_for(self.app).effects, self.job)


def last_report(effects: SqlEffects, job_key: str) -> dict[str, Any] | None:
    """The stored report of a reconciliation job, if it ran."""
    with effects.engine.connect() as conn:
        text = conn.execute(
            select(stock_reconciliations.c.report).where(stock_reconciliations.c.job_key == job_key)
        ).scalar_one_or_none()
    return None if text is None else dict(json.loads(text))
