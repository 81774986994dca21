"""charge(): one ledger row and one debit per payment, through duplicates, conflicts and zombies."""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import func, select, update

from demo.shop.faults import DemoFaults, TransientError, install_faults
from demo.shop.ledger import (
    InvalidInput,
    accounts,
    balance_of,
    open_account,
    payment_rows,
    payments,
)
from demo.shop.payments import CHARGE, apply_charge
from jobfence.locks import StaleFence
from jobfence.tasks import (
    DUPLICATE,
    SUPERSEDED,
    IdempotencyConflict,
    JobContext,
    JobSpec,
    runtime_for,
)
from tests.workflows import answer_or_duplicate, eager_app


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _charge_task(app: Celery) -> Any:
    return app.tasks[CHARGE]


def _open(app: Celery, balance: int = 10_000, currency: str = "EUR") -> str:
    account = _id("acct")
    open_account(runtime_for(app).effects.engine, account, currency=currency, balance_cents=balance)
    return account


def _payment_count(app: Celery, account: str) -> int:
    with runtime_for(app).effects.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).select_from(payments).where(payments.c.account == account)
            ).scalar_one()
        )


def test_charge_is_applied_once_however_it_is_called(app: Celery) -> None:
    task = _charge_task(app)
    account = _open(app)
    pid = _id("pay")
    first = task.delay(pid, account, 2_500, "EUR").get()
    assert first["status"] == "charged"
    assert first["balance_cents"] == 7_500
    again = [
        task.delay(pid, account, 2_500, "EUR").get(),
        task.apply_async(
            kwargs={"payment_id": pid, "account": account, "amount_cents": 2_500, "currency": "EUR"}
        ).get(),
        task(pid, account, amount_cents=2_500, currency="EUR"),  # called directly
        task.apply((pid, account, 2_500, "EUR")).get(),
    ]
    assert all(r == first for r in again)
    engine = runtime_for(app).effects.engine
    assert balance_of(engine, account) == 7_500
    assert _payment_count(app, account) == 1
    (row,) = payment_rows(engine, pid)
    assert row["amount_cents"] == 2_500 and row["fence"] == first["fence"]


def test_charge_is_applied_once_after_the_lock_server_lost_everything(
    app: Celery, redis_client: redis.Redis
) -> None:
    task = _charge_task(app)
    account = _open(app)
    pid = _id("pay")
    first = task.delay(pid, account, 1_000, "EUR").get()
    redis_client.flushall()  # DONE records, fence counters, locks: all gone
    assert task.delay(pid, account, 1_000, "EUR").get() == first  # replayed from SQL
    assert balance_of(runtime_for(app).effects.engine, account) == 9_000
    assert _payment_count(app, account) == 1


@pytest.mark.parametrize("lose_redis", [False, True], ids=["redis-record", "sql-record"])
def test_same_payment_with_other_terms_conflicts_and_changes_nothing(
    app: Celery, redis_client: redis.Redis, lose_redis: bool
) -> None:
    task = _charge_task(app)
    account = _open(app)
    other = _open(app)
    pid = _id("pay")
    first = task.delay(pid, account, 500, "EUR").get()
    if lose_redis:
        redis_client.flushall()
    for args in [(pid, account, 700, "EUR"), (pid, other, 500, "EUR"), (pid, account, 500, "USD")]:
        with pytest.raises(IdempotencyConflict):
            task.delay(*args).get()
    engine = runtime_for(app).effects.engine
    assert balance_of(engine, account) == 9_500
    assert balance_of(engine, other) == 10_000
    assert payment_rows(engine, pid)[0]["amount_cents"] == 500
    assert task.delay(pid, account, 500, "EUR").get() == first  # the original still replays


def test_payment_id_is_unique_across_explicit_idempotency_keys(app: Celery) -> None:
    """The ledger itself refuses a second charge of a payment id under another job key."""
    task = _charge_task(app)
    account = _open(app)
    pid = _id("pay")
    first = task.apply_async((pid, account, 300, "EUR"), idempotency_key="checkout-1").get()
    same = task.apply_async((pid, account, 300, "EUR"), idempotency_key="checkout-2").get()
    assert same == first
    with pytest.raises(IdempotencyConflict):
        task.apply_async((pid, account, 999, "EUR"), idempotency_key="checkout-3").get()
    assert balance_of(runtime_for(app).effects.engine, account) == 9_700
    assert _payment_count(app, account) == 1


def test_a_zombie_that_wakes_after_the_new_holder_committed_is_refused(app: Celery) -> None:
    """A holds the lease and stalls inside the body; its lease is taken over; B charges.

    When A goes on, its transaction is refused with StaleFence (the executor reports it as
    superseded) and the ledger keeps B's single row.
    """
    rt = runtime_for(app)
    task = _charge_task(app)
    account = _open(app)
    pid = _id("pay")
    args = {"payment_id": pid, "account": account, "amount_cents": 4_000, "currency": "EUR"}
    key, fp = task.identity((), args)
    spec = JobSpec(name=CHARGE, key=key, fingerprint=fp, ttl=30.0, result_ttl=600.0)
    inside, go_on = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def zombie_body(job: JobContext) -> Any:
        seen["fence"] = job.fence
        inside.set()
        assert go_on.wait(30), "the test never let the zombie go on"
        try:
            return apply_charge(rt.effects, job, **args)
        except StaleFence as exc:
            seen["stale"] = exc
            raise

    outcomes: list[Any] = []
    zombie = threading.Thread(target=lambda: outcomes.append(rt.executor.run(spec, zombie_body)))
    zombie.start()
    assert inside.wait(30)
    assert rt.backend.force_release(key)  # A's lease "expired" while it was frozen
    newer = task.delay(**args).get()
    assert newer["status"] == "charged" and newer["fence"] > seen["fence"]
    go_on.set()
    zombie.join(30)
    assert not zombie.is_alive()
    assert outcomes[0].status == "superseded" and outcomes[0].value == SUPERSEDED
    assert isinstance(seen["stale"], StaleFence)
    assert seen["stale"].last == newer["fence"]
    engine = rt.effects.engine
    assert balance_of(engine, account) == 6_000
    assert [r["fence"] for r in payment_rows(engine, pid)] == [newer["fence"]]


def test_a_zombie_that_wrote_first_is_not_repeated_by_the_new_holder(app: Celery) -> None:
    rt = runtime_for(app)
    task = _charge_task(app)
    account = _open(app)
    pid = _id("pay")
    args = {"payment_id": pid, "account": account, "amount_cents": 1_200, "currency": "EUR"}
    key, fp = task.identity((), args)
    lease = rt.backend.try_acquire(key, 30.0)
    assert lease is not None
    rt.backend.force_release(key)  # the lease is gone, but A does not know yet
    written = apply_charge(rt.effects, JobContext(key=key, fingerprint=fp, lease=lease), **args)
    assert written["fence"] == lease.fence
    assert task.delay(**args).get() == written  # B finds A's DONE row and replays it
    assert balance_of(rt.effects.engine, account) == 8_800
    assert _payment_count(app, account) == 1


def test_concurrent_payments_on_one_account_all_apply_and_never_overdraw(app: Celery) -> None:
    """Many payments share one account: none is refused as stale, none applied twice."""
    task = _charge_task(app)
    account = _open(app, balance=50_000)
    amounts = {_id("pay"): 1_000 + 100 * i for i in range(40)}  # total 118_000 > balance
    calls = [(pid, amt) for pid, amt in amounts.items()] * 2  # every payment sent twice

    def send(call: tuple[str, int]) -> tuple[str, Any]:
        # apply(), not delay(): eager apply_async flips a process-global "no join" flag,
        # which races between threads.
        return call[0], answer_or_duplicate(
            lambda: task.apply((call[0], account, call[1], "EUR")).get(disable_sync_subtasks=False)
        )

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, calls))
    # None refused as stale: a JobSuperseded would have raised above.
    final: dict[str, Any] = {}
    for pid, amt in amounts.items():
        final[pid] = task.delay(pid, account, amt, "EUR").get()  # the stored answer
        for got_pid, r in results:
            if got_pid == pid and r != DUPLICATE:
                assert r == final[pid]
    charged = sum(amounts[p] for p, r in final.items() if r["status"] == "charged")
    declined = [p for p, r in final.items() if r["status"] == "declined"]
    engine = runtime_for(app).effects.engine
    balance = balance_of(engine, account)
    assert balance is not None and balance >= 0
    assert balance == 50_000 - charged
    assert declined and all(final[p]["reason"] == "insufficient funds" for p in declined)
    assert all(amounts[p] > balance for p in declined)  # balance only falls: refused rightly
    assert _payment_count(app, account) == len(amounts) - len(declined)


def test_a_declined_charge_is_stored_and_replayed(app: Celery) -> None:
    task = _charge_task(app)
    account = _open(app, balance=100)
    pid = _id("pay")
    declined = task.delay(pid, account, 500, "EUR").get()
    assert declined["status"] == "declined" and declined["reason"] == "insufficient funds"
    engine = runtime_for(app).effects.engine
    with engine.begin() as conn:
        conn.execute(
            update(accounts).where(accounts.c.account == account).values(balance_cents=10_000)
        )
    assert task.delay(pid, account, 500, "EUR").get() == declined
    assert task.delay(_id("pay"), account, 500, "EUR").get()["status"] == "charged"
    unknown = task.delay(_id("pay"), _id("nobody"), 500, "EUR").get()
    assert unknown["status"] == "declined" and unknown["reason"] == "unknown account"
    mismatch = task.delay(_id("pay"), account, 500, "USD").get()
    assert mismatch["status"] == "declined" and "currency" in mismatch["reason"]
    assert balance_of(engine, account) == 9_500


@pytest.mark.parametrize(
    ("field", "args"),
    [
        ("payment_id", ("", "acct", 100, "EUR")),
        ("payment_id", (" p1", "acct", 100, "EUR")),
        ("account", ("p1", "", 100, "EUR")),
        ("amount_cents", ("p1", "acct", 0, "EUR")),
        ("amount_cents", ("p1", "acct", -5, "EUR")),
        ("amount_cents", ("p1", "acct", 1.5, "EUR")),
        ("amount_cents", ("p1", "acct", True, "EUR")),
        ("currency", ("p1", "acct", 100, "eur")),
        ("currency", ("p1", "acct", 100, "EURO")),
        ("currency", ("p1", "acct", 100, "ABC")),
    ],
)
def test_invalid_arguments_are_refused_naming_the_field(
    app: Celery, field: str, args: tuple[Any, ...]
) -> None:
    task = _charge_task(app)
    account = _open(app)
    args = tuple(account if a == "acct" else a for a in args)
    with pytest.raises(InvalidInput) as info:
        task.delay(*args).get()
    assert info.value.field == field and field in str(info.value)
    assert balance_of(runtime_for(app).effects.engine, account) == 10_000
    assert _payment_count(app, account) == 0


def test_a_demo_fault_fails_the_first_attempt_and_the_retry_charges_once(
    redis_url: str, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = eager_app(redis_url, database_url, propagate=False)  # eager retries need this
    try:
        task = _charge_task(app)
        account = _open(app)
        install_faults(app, DemoFaults(fail_rate=1.0, delay_min_ms=1, delay_max_ms=5))
        pid = _id("pay")
        with pytest.raises(TransientError):
            task(pid, account, 100, "EUR")  # called directly there is no retry: it shows
        with caplog.at_level(logging.INFO, logger="demo.shop.faults"):
            result = task.delay(pid, account, 100, "EUR").get()  # fails, retries, charges
        assert result["status"] == "charged"
        assert [r for r in caplog.records if "fails its first attempt" in r.getMessage()]
        assert balance_of(runtime_for(app).effects.engine, account) == 9_900
        assert _payment_count(app, account) == 1
        install_faults(app, DemoFaults(fail_rate=0.0))
        assert task.delay(_id("pay"), account, 100, "EUR").get()["status"] == "charged"
    finally:
        runtime_for(app).close()


def test_demo_fault_choice_is_a_stable_function_of_the_id() -> None:
    faults = DemoFaults(fail_rate=0.25, seed="s1")
    ids = [f"pay-{i}" for i in range(4000)]
    same, reseeded, off = (
        DemoFaults(fail_rate=0.25, seed="s1"),
        DemoFaults(fail_rate=0.25, seed="s2"),
        DemoFaults(fail_rate=0.0),
    )
    chosen = {i for i in ids if faults.fails_once(i)}
    assert chosen == {i for i in ids if same.fails_once(i)}
    assert 0.22 < len(chosen) / len(ids) < 0.28
    assert chosen != {i for i in ids if reseeded.fails_once(i)}
    assert not any(off.fails_once(i) for i in ids)
    with pytest.raises(ValueError):
        DemoFaults(delay_min_ms=200, delay_max_ms=50)
    with pytest.raises(ValueError):
        DemoFaults(fail_rate=1.5)
