"""The shop's Django tests with jobfence.testing: each test gets a fresh in-memory lock server
(``JobfenceTestCase`` first in the bases, or ``in_memory()`` as a context manager), so
nothing reaches the configured lock server and no test's record answers another's."""

from __future__ import annotations

from django.test import TestCase

from jobfence.testing import JobfenceTestCase, in_memory
from tests.django_project.celery import app
from tests.django_project.shop.models import Account, Payment
from tests.django_project.shop.tasks import charge

PAYMENT, ACCOUNT, AMOUNT = 4343, 78, 100


class ChargeWithJobfenceTests(JobfenceTestCase, TestCase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        Account.objects.create(pk=ACCOUNT, balance_cents=1000)

    def assert_charged_once(self) -> None:
        self.assertEqual(Payment.objects.filter(payment_id=PAYMENT).count(), 1)
        self.assertEqual(Account.objects.get(pk=ACCOUNT).balance_cents, 1000 - AMOUNT)

    def test_a_duplicate_publish_charges_once(self) -> None:
        self.jobfence.publish_duplicate(charge, PAYMENT, ACCOUNT, AMOUNT)
        self.assert_charged_once()

    def test_a_redelivery_charges_once(self) -> None:
        self.jobfence.redeliver(charge, PAYMENT, ACCOUNT, AMOUNT)
        self.assert_charged_once()

    def test_a_direct_call_apply_and_eager_delay_charge_once(self) -> None:
        charge(PAYMENT, ACCOUNT, AMOUNT)
        charge.apply(args=(PAYMENT, ACCOUNT, AMOUNT)).get()
        app.conf.task_always_eager = True
        try:
            charge.delay(PAYMENT, ACCOUNT, AMOUNT).get()
        finally:
            app.conf.task_always_eager = False
        self.assert_charged_once()  # the ledger's row answered the later calls (see README)

    def test_the_lock_server_down_at_begin_charges_once(self) -> None:
        self.jobfence.unavailable_at_begin(charge, PAYMENT, ACCOUNT, AMOUNT)
        self.assert_charged_once()


class ContextManagerTests(TestCase):  # type: ignore[misc]
    def test_in_memory_as_a_context_manager(self) -> None:
        Account.objects.create(pk=ACCOUNT, balance_cents=1000)
        with in_memory() as jf:
            charge.apply(args=(PAYMENT, ACCOUNT, AMOUNT))
            jf.assert_ran_once(charge, PAYMENT)
        self.assertEqual(Payment.objects.filter(payment_id=PAYMENT).count(), 1)
