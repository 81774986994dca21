"""The shop's own Django tests, as a user writes them: TestCase, the task run in-process.

Every test charges the same payment of the same account: each must start clean, in one
``manage.py test`` run and across runs (``tests/test_django_testcase.py`` runs them twice).
"""

from __future__ import annotations

from django.test import TestCase

from tests.django_project.celery import app
from tests.django_project.shop.models import Account, Payment
from tests.django_project.shop.tasks import charge

PAYMENT, ACCOUNT, AMOUNT = 4242, 77, 100


class ChargeTests(TestCase):  # type: ignore[misc]
    def setUp(self) -> None:
        Account.objects.create(pk=ACCOUNT, balance_cents=1000)

    def assert_charged_once(self) -> None:
        self.assertEqual(Payment.objects.filter(payment_id=PAYMENT).count(), 1)
        self.assertEqual(Account.objects.get(pk=ACCOUNT).balance_cents, 1000 - AMOUNT)

    def test_a_direct_call_charges_once(self) -> None:
        expected = {"payment_id": PAYMENT, "charged": AMOUNT}
        self.assertEqual(charge(PAYMENT, ACCOUNT, AMOUNT), expected)
        self.assertEqual(charge(PAYMENT, ACCOUNT, AMOUNT), expected)  # replayed
        self.assert_charged_once()

    def test_apply_charges_once(self) -> None:
        charge.apply(args=(PAYMENT, ACCOUNT, AMOUNT)).get()
        self.assert_charged_once()

    def test_an_eager_delay_charges_once(self) -> None:
        app.conf.task_always_eager = True
        try:
            charge.delay(PAYMENT, ACCOUNT, AMOUNT).get()
        finally:
            app.conf.task_always_eager = False
        self.assert_charged_once()
