"""The Django tasks under test: the same charge with jobfence's gate and without it."""

from __future__ import annotations

import os
import time

from django.db import connection

import jobfence
from jobfence.tasks.django_tasks import fenced

try:  # Django 6
    from django.tasks import task
except ImportError:  # the backport, Django 4.2-5.x
    from django_tasks import task

#: Seconds each charge takes: past the broker's visibility timeout, so copies overlap and
#: the broker redelivers running ones.
SLOW = float(os.environ.get("BILLING_SLOW_SECONDS", "0"))


def _write(invoice_id: int, amount: int, via: str, fence: int | None) -> None:
    time.sleep(SLOW)  # a slow payment provider; not synchronisation
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO billing_charge (invoice_id, amount, via, fence, pid) "
            "VALUES (%s, %s, %s, %s, %s)",
            [invoice_id, amount, via, fence, os.getpid()],
        )


@task()  # the gate's options under it: Django 6.0's task() takes no extra keywords
@fenced(key="invoice_id")
def charge(invoice_id: int, amount: int) -> int:
    _write(invoice_id, amount, "jobfence", jobfence.current_job().fence)
    return invoice_id


@task(backend="plain")
def charge_plain(invoice_id: int, amount: int) -> int:
    _write(invoice_id, amount, "plain", None)
    return invoice_id
