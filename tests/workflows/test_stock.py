"""reserve() never oversells and reserves an order once; reconcile_stock() runs once per slot."""

from __future__ import annotations

import multiprocessing
import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import func, select, update

from demo.shop.ledger import (
    InvalidInput,
    reservations,
    reserved_total,
    seed_stock,
    stock,
    stock_of,
    stock_reconciliations,
)
from demo.shop.stock import RECONCILE, RESERVE, apply_reservation, last_report
from jobfence.locks import StaleFence
from jobfence.tasks import DUPLICATE, IdempotencyConflict, JobContext, runtime_for
from tests.workflows import answer_or_duplicate, reserve_in_process


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _reserve_task(app: Celery) -> Any:
    return app.tasks[RESERVE]


def _sku(app: Celery, level: int) -> str:
    sku = _id("sku")
    seed_stock(runtime_for(app).effects.engine, {sku: level})
    return sku


def _reservation_rows(app: Celery, sku: str) -> dict[str, int]:
    with runtime_for(app).effects.engine.connect() as conn:
        rows = conn.execute(
            select(reservations.c.order_id, reservations.c.qty).where(reservations.c.sku == sku)
        ).all()
    return {r.order_id: int(r.qty) for r in rows}


def _check_no_oversell(
    app: Celery, sku: str, initial: int, orders: dict[str, int], answers: dict[str, Any]
) -> None:
    """Stock never negative, reserved == initial - final, each answer matches the ledger."""
    engine = runtime_for(app).effects.engine
    final = stock_of(engine, sku)
    assert final is not None and final >= 0
    rows = _reservation_rows(app, sku)
    assert sum(rows.values()) == reserved_total(engine, sku) == initial - final
    for order_id, qty in orders.items():
        answer = answers[order_id]
        if answer["status"] == "reserved":
            assert rows[order_id] == qty
        else:
            assert answer == {
                "status": "refused",
                "reason": "insufficient stock",
                "order_id": order_id,
                "sku": sku,
                "qty": qty,
                "available": answer["available"],
            }
            assert order_id not in rows
            assert answer["available"] < qty and final < qty  # refused only when short
    assert set(rows) == {o for o, a in answers.items() if a["status"] == "reserved"}


def test_an_order_is_reserved_once(app: Celery, redis_client: redis.Redis) -> None:
    task = _reserve_task(app)
    sku = _sku(app, 10)
    first = task.delay("order-1", sku, 3).get()
    assert first["status"] == "reserved" and first["remaining"] == 7
    assert task.delay("order-1", sku, 3).get() == first
    assert task(order_id="order-1", sku=sku, qty=3) == first
    redis_client.flushall()
    assert task.delay("order-1", sku, 3).get() == first  # replayed from the SQL DONE row
    assert stock_of(runtime_for(app).effects.engine, sku) == 7
    assert _reservation_rows(app, sku) == {"order-1": 3}
    with pytest.raises(IdempotencyConflict):
        task.delay("order-1", sku, 4).get()
    assert stock_of(runtime_for(app).effects.engine, sku) == 7


def test_a_refusal_is_stored_and_replayed(app: Celery, redis_client: redis.Redis) -> None:
    task = _reserve_task(app)
    sku = _sku(app, 5)
    refused = task.delay("big-order", sku, 8).get()
    assert refused == {
        "status": "refused",
        "reason": "insufficient stock",
        "order_id": "big-order",
        "sku": sku,
        "qty": 8,
        "available": 5,
    }
    engine = runtime_for(app).effects.engine
    seed_stock(engine, {sku: 20})  # restocked: the order's answer stays the same
    assert task.delay("big-order", sku, 8).get() == refused
    redis_client.flushall()
    assert task.delay("big-order", sku, 8).get() == refused
    assert task.delay("other-order", sku, 8).get()["status"] == "reserved"
    assert stock_of(engine, sku) == 17
    unknown = task.delay("lost-order", _id("nosuch"), 1).get()
    assert unknown["status"] == "refused" and unknown["reason"] == "unknown sku"


def test_concurrent_orders_from_threads_never_oversell(app: Celery) -> None:
    task = _reserve_task(app)
    initial = 40
    sku = _sku(app, initial)
    rng = random.Random(7)
    orders = {_id("order"): rng.randint(1, 3) for _ in range(36)}  # ~72 units asked for
    calls = list(orders.items()) * 2  # every order twice
    rng.shuffle(calls)

    def send(call: tuple[str, int]) -> tuple[str, Any]:
        # apply(), not delay(): eager apply_async flips a process-global flag (racy).
        return call[0], answer_or_duplicate(
            lambda: task.apply((call[0], sku, call[1])).get(disable_sync_subtasks=False)
        )

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, calls))
    # No live order refused as stale: a JobSuperseded would have raised above.
    answers = {o: task.delay(o, sku, q).get() for o, q in orders.items()}  # stored answers
    for order_id, r in results:
        assert r in (DUPLICATE, answers[order_id])
    assert {a["status"] for a in answers.values()} == {"reserved", "refused"}
    _check_no_oversell(app, sku, initial, orders, answers)


def test_concurrent_orders_from_processes_never_oversell(
    app: Celery, redis_url: str, database_url: str
) -> None:
    task = _reserve_task(app)
    initial = 30
    sku = _sku(app, initial)
    rng = random.Random(11)
    orders = {_id("order"): rng.randint(1, 3) for _ in range(30)}
    items = list(orders.items())
    workers = 4
    plans: list[list[tuple[str, str, int]]] = []
    for w in range(workers):
        mine = items[w::workers] + rng.sample(items, 4)  # plus duplicates of others' orders
        rng.shuffle(mine)
        plans.append([(o, sku, q) for o, q in mine])
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(workers)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=reserve_in_process, args=(redis_url, database_url, plan, start, out))
        for plan in plans
    ]
    for p in procs:
        p.start()
    try:
        results = [pair for _ in procs for pair in out.get(timeout=120)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [r for o, r in results if o == "<error>"]
    assert not errors, errors
    # No live order refused as stale: a JobSuperseded would have failed the process.
    answers = {o: task.delay(o, sku, q).get() for o, q in orders.items()}
    for order_id, r in results:
        assert r in (DUPLICATE, answers[order_id])
    _check_no_oversell(app, sku, initial, orders, answers)


def test_a_zombie_reservation_is_refused_and_stock_moves_once(app: Celery) -> None:
    rt = runtime_for(app)
    task = _reserve_task(app)
    sku = _sku(app, 10)
    args = {"order_id": _id("order"), "sku": sku, "qty": 4}
    key, fp = task.identity((), args)
    lease = rt.backend.try_acquire(key, 30.0)  # zombie A
    assert lease is not None
    assert rt.backend.force_release(key)  # A froze past its TTL
    newer = task.delay(**args).get()  # B takes over and reserves
    assert newer["status"] == "reserved" and newer["fence"] > lease.fence
    with pytest.raises(StaleFence):
        apply_reservation(rt.effects, JobContext(key=key, fingerprint=fp, lease=lease), **args)
    assert stock_of(rt.effects.engine, sku) == 6
    assert _reservation_rows(app, sku) == {args["order_id"]: 4}


@pytest.mark.parametrize(
    ("field", "args"),
    [
        ("order_id", ("", "sku-1", 1)),
        ("sku", ("o-1", "", 1)),
        ("sku", ("o-1", "x" * 129, 1)),
        ("qty", ("o-1", "sku-1", 0)),
        ("qty", ("o-1", "sku-1", 2.0)),
        ("qty", ("o-1", "sku-1", "3")),
    ],
)
def test_invalid_arguments_are_refused_naming_the_field(
    app: Celery, field: str, args: tuple[Any, ...]
) -> None:
    with pytest.raises(InvalidInput) as info:
        _reserve_task(app).delay(*args).get()
    assert info.value.field == field


def test_reconciliation_runs_once_per_slot_and_reports_mismatches(app: Celery) -> None:
    rt = runtime_for(app)
    reconcile = app.tasks[RECONCILE]
    task = _reserve_task(app)
    a, b = _sku(app, 10), _sku(app, 5)
    task.delay("o-a", a, 4).get()
    task.delay("o-b", b, 5).get()
    first = reconcile.apply_async(idempotency_key="reconcile:2024-06-01").get()
    assert first["status"] == "ok" and first["skus_checked"] == 2 and first["mismatches"] == []
    with rt.effects.engine.begin() as conn:  # someone "fixes" stock by hand
        conn.execute(update(stock).where(stock.c.sku == a).values(quantity=9))
    assert reconcile.apply_async(idempotency_key="reconcile:2024-06-01").get() == first
    second = reconcile.apply_async(idempotency_key="reconcile:2024-06-02").get()
    assert second["status"] == "mismatch"
    assert second["mismatches"] == [
        {"sku": a, "on_hand": 9, "expected": 6, "received": 10, "reserved": 4}
    ]
    key, _ = reconcile.identity((), {}, "reconcile:2024-06-02")
    assert last_report(rt.effects, key) == second
    with pytest.raises(InvalidInput) as info:
        reconcile.delay().get()  # no slot: refused rather than replaying one report forever
    assert info.value.field == "idempotency_key"
    with rt.effects.engine.connect() as conn:
        reports = conn.execute(select(func.count()).select_from(stock_reconciliations)).scalar()
    assert reports == 2
