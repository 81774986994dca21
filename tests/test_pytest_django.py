"""The `jobfence` fixture under pytest-django: a user's suite (run in a subprocess on real
PostgreSQL) charges the shop's payment through `publish_duplicate` and `redeliver` under the
default `django_db` (one rolled-back transaction per test) and `django_db(transaction=True)`;
in both, the duplicate is absorbed by the DONE record and the payment is charged once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase

pytest.importorskip("django")
pytest.importorskip("pytest_django")
pytest_plugins = ["pytester"]

REPO_ROOT = Path(__file__).resolve().parents[1]

TEST_SHOP = """
import pytest

from tests.django_project.shop.models import Account, Payment
from tests.django_project.shop.tasks import charge

PAYMENT, ACCOUNT, AMOUNT = 4343, 78, 100


@pytest.fixture(params=["publish_duplicate", "redeliver"])
def fault(request, jobfence):
    return getattr(jobfence, request.param)


def charged_once(jobfence):
    assert Payment.objects.filter(payment_id=PAYMENT).count() == 1
    assert Account.objects.get(pk=ACCOUNT).balance_cents == 1000 - AMOUNT
    jobfence.assert_ran_once(charge, PAYMENT)
    jobfence.assert_absorbed(charge, PAYMENT)


@pytest.mark.django_db
def test_in_a_transaction_per_test(jobfence, fault):
    Account.objects.create(pk=ACCOUNT, balance_cents=1000)
    fault(charge, PAYMENT, ACCOUNT, AMOUNT)
    charged_once(jobfence)


@pytest.mark.django_db(transaction=True)
def test_with_transaction_true(jobfence, fault):
    Account.objects.create(pk=ACCOUNT, balance_cents=1000)
    fault(charge, PAYMENT, ACCOUNT, AMOUNT)
    charged_once(jobfence)
"""


def test_the_fixture_absorbs_a_duplicate_under_both_django_db_modes(
    pytester: pytest.Pytester, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    for name in [k for k in os.environ if k.startswith("JOBFENCE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(REPO_ROOT), os.environ.get("PYTHONPATH")])))  # fmt: skip
    monkeypatch.setenv("SHOP_BROKER_URL", "memory://localhost/")
    monkeypatch.setenv("SHOP_LOCK_URL", redis_url)  # configured; the fixture's server answers
    monkeypatch.setenv("COLUMNS", "400")
    pytester.makepyfile(test_shop=TEST_SHOP)
    with PostgresDatabase() as db:
        monkeypatch.setenv("SHOP_DB_NAME", db.name)  # pytest-django makes test_<name> beside it
        result = pytester.runpytest_subprocess(
            "--ds", "tests.django_project.settings", "-p", "no:cacheprovider",
            "-p", "no:randomly", "-rf", timeout=120,
        )  # fmt: skip
    result.assert_outcomes(passed=4)
