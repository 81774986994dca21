"""The shop's tasks: a payment charged under jobfence, its naive twin, and a stale writer.

``SHOP_SLOW_PAYMENTS`` (comma list of payment ids) makes ``shop.charge`` and
``shop.charge_plain`` hold those payments for ``SHOP_SLOW_SECONDS`` before charging, longer
than the broker's visibility timeout, so the broker redelivers them while they run. While
it holds, a process marks ``$SHOP_HOLD_DIR/<payment>.<pid>`` (for tests that freeze it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import shared_task
from django.db import transaction
from django.db.models import F

from jobfence.locks.errors import StaleFence
from jobfence.tasks import singleton_task
from jobfence.tasks.django import django_effects, fence_guard
from tests.django_project.shop.models import Account, Payment


def _hold_if_slow(payment_id: int) -> None:
    slow = {int(p) for p in os.environ.get("SHOP_SLOW_PAYMENTS", "").split(",") if p}
    if payment_id in slow:
        hold_dir = os.environ.get("SHOP_HOLD_DIR")
        if hold_dir:
            Path(hold_dir, f"{payment_id}.{os.getpid()}").touch()
        time.sleep(float(os.environ.get("SHOP_SLOW_SECONDS", "3")))


def _charge(
    payment_id: int, account_id: int, amount_cents: int, via: str, fence: int | None
) -> None:
    Payment.objects.create(
        payment_id=payment_id,
        account_id=account_id,
        amount_cents=amount_cents,
        via=via,
        fence=fence,
        pid=os.getpid(),
    )
    Account.objects.filter(pk=account_id).update(balance_cents=F("balance_cents") - amount_cents)


@singleton_task(name="shop.charge", bind=True, key=["payment_id"])
def charge(self: Any, payment_id: int, account_id: int, amount_cents: int) -> dict[str, Any]:
    _hold_if_slow(payment_id)
    with django_effects.transaction(self.job, f"payment:{payment_id}") as tx:
        if tx.done:
            return tx.result  # type: ignore[no-any-return]
        _charge(payment_id, account_id, amount_cents, "jobfence", self.job.fence)
        tx.result = {"payment_id": payment_id, "charged": amount_cents}
    return tx.result  # type: ignore[no-any-return]


@shared_task(name="shop.charge_plain")
def charge_plain(payment_id: int, account_id: int, amount_cents: int) -> dict[str, Any]:
    """The control: the same effect with no lock, no fence and no DONE record."""
    _hold_if_slow(payment_id)
    with transaction.atomic():
        _charge(payment_id, account_id, amount_cents, "plain", None)
    return {"payment_id": payment_id, "charged": amount_cents}


@shared_task(name="shop.fenced_write", ignore_result=False)
def fenced_write(payment_id: int, account_id: int, amount_cents: int, fence: int) -> str:
    """Charge first, check the fence after, in one atomic block: a stale fence undoes it."""
    try:
        with transaction.atomic():
            _charge(payment_id, account_id, amount_cents, "fenced", fence)
            fence_guard.check_and_advance(f"payment:{payment_id}", fence)
    except StaleFence:
        return "stale"
    return "written"
