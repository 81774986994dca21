"""Accounts and payments. ``payment_id`` is not unique on purpose: only jobfence stands
between a redelivered message and a second charge (as in most real schemas, where the
payment row has its own id and the message id is nowhere)."""

from __future__ import annotations

from django.db import models


class Account(models.Model):
    balance_cents = models.BigIntegerField(default=0)


class Payment(models.Model):
    payment_id = models.IntegerField(db_index=True)
    account = models.ForeignKey(Account, on_delete=models.PROTECT)
    amount_cents = models.BigIntegerField()
    via = models.CharField(max_length=16)  # "jobfence" or "plain" (the control)
    fence = models.BigIntegerField(null=True)
    pid = models.IntegerField()
