"""Helpers for the workflow tests: an eager Celery app with a jobfence runtime and a ledger."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

import demo.shop.payments
import demo.shop.stock
from demo.shop.faults import DemoFaults, install_faults
from demo.shop.ledger import create_schema
from jobfence.config import Settings
from jobfence.tasks import DUPLICATE, DuplicateSkipped, install, runtime_for

__all__ = ["answer_or_duplicate", "eager_app", "reserve_in_process"]

# imported: their shared tasks register
WORKFLOW_MODULES = (demo.shop.payments, demo.shop.stock)


def eager_app(
    lock_url: str,
    database_url: str,
    *,
    create: bool = True,
    propagate: bool = True,
    **settings: Any,
) -> Celery:
    """A Celery app that runs tasks in the caller (task_always_eager), with a runtime installed.

    With ``propagate`` exceptions raise from ``delay()``/``apply_async()``; Celery then also
    raises ``Retry`` instead of running the retry, so retry tests pass ``propagate=False``
    (errors still raise from ``.get()``). Tasks come from ``app.tasks[name]``: the shared-task
    proxies would resolve to Celery's default app, which has no runtime. Demo faults are
    off whatever JOBFENCE_DEMO_* says; tests install their own.
    """
    app = Celery("jobfence-workflows", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=propagate)
    runtime = install(app, Settings(lock_url=lock_url, database_url=database_url, **settings))
    install_faults(app, DemoFaults(fail_rate=0.0, delay_min_ms=0.0, delay_max_ms=0.0))
    if create:
        create_schema(runtime.effects.engine)
    return app


def answer_or_duplicate(call: Callable[[], Any]) -> Any:
    """The job's answer, or DUPLICATE where a copy was running (any other stop raises)."""
    try:
        return call()
    except DuplicateSkipped:
        return DUPLICATE


def reserve_in_process(
    lock_url: str,
    database_url: str,
    orders: list[tuple[str, str, int]],
    start: Any,
    out: Any,
) -> None:
    """Process target: wait at the ``start`` barrier, reserve ``orders``, put the results."""
    app = eager_app(lock_url, database_url, create=False)
    task = app.tasks[demo.shop.stock.RESERVE]
    results: list[tuple[str, Any]] = []
    try:
        start.wait(60)
        for order_id, sku, qty in orders:
            got = answer_or_duplicate(lambda: task.delay(order_id, sku, qty).get())  # noqa: B023
            results.append((order_id, got))
    except BaseException as exc:  # report, so the parent fails with the cause
        results.append(("<error>", f"{type(exc).__name__}: {exc}"))
    finally:
        out.put(results)
        runtime_for(app).close()
