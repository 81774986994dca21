"""Payments: charge(payment_id, ...) debits an account once, however often it is delivered.

The ledger row, the balance change and the job's DONE row commit in one transaction,
fenced on the job's own resource (see tasks.ledger.job_resource). The account row, which
many payments share, is serialised by a row lock and changed by a conditional UPDATE, not
by a fence: fences of different payments come from different lease keys and are not
comparable. tasks.stock explains this choice in full.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError

from demo.shop.faults import TransientError, faults_for
from demo.shop.ledger import (
    AMOUNT_MAX,
    accounts,
    check_currency,
    check_id,
    check_positive_int,
    insert_effect,
    job_resource,
    now,
    payments,
)
from jobfence.tasks.celery_task import SingletonTask, singleton_task
from jobfence.tasks.context import JobContext
from jobfence.tasks.effects import SqlEffects
from jobfence.tasks.errors import IdempotencyConflict
from jobfence.tasks.runtime import runtime_for

CHARGE = "tasks.payments.charge"


def check_charge(payment_id: Any, account: Any, amount_cents: Any, currency: Any) -> None:
    """Raise InvalidInput naming the first unusable argument."""
    check_id("payment_id", payment_id)
    check_id("account", account)
    check_positive_int("amount_cents", amount_cents, AMOUNT_MAX)
    check_currency("currency", currency)


def apply_charge(
    effects: SqlEffects,
    job: JobContext,
    payment_id: str,
    account: str,
    amount_cents: int,
    currency: str,
) -> dict[str, Any]:
    """The effect of one charge, fenced and recorded with the job's DONE row.

    Returns the stored result: status "charged", or "declined" with a reason (unknown
    account, currency mismatch, insufficient funds); a declined charge is DONE too, so a
    duplicate gets the same answer. Raises StaleFence if a newer holder of the job wrote
    first, IdempotencyConflict if the payment id was used with other terms.
    """
    check_charge(payment_id, account, amount_cents, currency)
    terms = {
        "payment_id": payment_id,
        "account": account,
        "amount_cents": amount_cents,
        "currency": currency,
    }
    with effects.transaction(job, job_resource(job)) as tx:
        if tx.done:
            return dict(tx.result)
        conn = tx.conn
        # The ledger is the business-level record: a payment id charged under another job
        # key (an explicit idempotency key) is found here, never charged twice.
        row = conn.execute(select(payments).where(payments.c.payment_id == payment_id)).first()
        if row is not None:
            if (row.account, row.amount_cents, row.currency) != (account, amount_cents, currency):
                raise IdempotencyConflict(
                    f"payment {payment_id!r} was charged with other terms "
                    f"({row.amount_cents} {row.currency} on {row.account!r}); nothing changed",
                    key=job.key,
                    fence=job.fence,
                )
            tx.result = _charged(terms, row.balance_after_cents, row.fence)
            return dict(tx.result)
        # Row lock on the shared account (PostgreSQL, MySQL); SQLite's BEGIN IMMEDIATE
        # already serialises writers. Different payments' deltas commute: no fence needed.
        acct = conn.execute(
            select(accounts.c.currency, accounts.c.balance_cents)
            .where(accounts.c.account == account)
            .with_for_update()
        ).first()
        if acct is None:
            tx.result = _declined(terms, "unknown account", None)
        elif acct.currency != currency:
            tx.result = _declined(terms, f"currency mismatch: account holds {acct.currency}", None)
        elif acct.balance_cents < amount_cents:
            tx.result = _declined(terms, "insufficient funds", int(acct.balance_cents))
        else:
            debited = conn.execute(
                update(accounts)
                .where(accounts.c.account == account, accounts.c.balance_cents >= amount_cents)
                .values(balance_cents=accounts.c.balance_cents - amount_cents)
            ).rowcount
            if debited != 1:  # cannot happen under the row lock; refuse rather than guess
                raise RuntimeError(f"account {account!r} changed under its row lock")
            after = int(acct.balance_cents) - amount_cents
            insert_effect(
                conn,
                payments.insert().values(
                    **terms, balance_after_cents=after, fence=job.fence, created_at=now()
                ),
                job,
                f"payment {payment_id!r} is being charged",
            )
            tx.result = _charged(terms, after, job.fence)
    return dict(tx.result)


def _charged(terms: dict[str, Any], balance: int, fence: int) -> dict[str, Any]:
    return {"status": "charged", **terms, "balance_cents": int(balance), "fence": int(fence)}


def _declined(terms: dict[str, Any], reason: str, balance: int | None) -> dict[str, Any]:
    return {"status": "declined", "reason": reason, **terms, "balance_cents": balance}


@singleton_task(
    bind=True,
    name=CHARGE,
    key=["payment_id"],
    autoretry_for=(TransientError, OperationalError),
    retry_backoff=True,  # countdown 2**retries s (capped), full jitter
    retry_backoff_max=10,
    retry_jitter=True,
    max_retries=5,
)
def charge(
    self: SingletonTask, payment_id: str, account: str, amount_cents: int, currency: str
) -> dict[str, Any]:
    """Charge `amount_cents` (> 0, in minor units) in `currency` to `account`, once.

    Keyed by payment_id: the same payment id with other arguments raises
    IdempotencyConflict and changes nothing. Demo faults (JOBFENCE_DEMO_*) may slow the
    body and fail its first attempt with TransientError, which is retried.
    """
    check_charge(payment_id, account, amount_cents, currency)
    faults_for(self.app).inject("payment", payment_id, self.request.retries or 0)
    effects = runtime_for(self.app).effects
    return apply_charge(effects, self.job, payment_id, account, amount_cents, currency)
