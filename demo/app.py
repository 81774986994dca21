"""The demo shop's Celery app: `celery -A demo.app worker|beat` builds it from JOBFENCE_*.

`create_shop_app` is `create_app` with the shop's task modules (payments, stock), its nightly
stock reconciliation and, when JOBFENCE_DEMO_JOURNAL_URL is set, the demo's journal: what
a user's own app names for itself, the demo names here.
"""

from __future__ import annotations

import sys
from typing import Any

from celery import Celery

from demo import journal
from jobfence.config import Settings, UnsafeSettings
from jobfence.config.errors import EX_CONFIG
from jobfence.tasks.runtime import runtime_for
from jobfence.worker.app import create_app, parse_crontab

SHOP_MODULES: tuple[str, ...] = ("demo.shop.payments", "demo.shop.stock")
RECONCILE_TASK = "tasks.stock.reconcile_stock"
RECONCILE_ENTRY = "reconcile-stock-nightly"
DEFAULT_RECONCILE_AT = "30 2 * * *"  # cron fields: minute hour day-of-month month day-of-week (UTC)


def shop_beat_schedule(reconcile_at: str | None = DEFAULT_RECONCILE_AT) -> dict[str, Any]:
    """The shop's periodic jobs: stock reconciliation, nightly (None: no entry)."""
    if reconcile_at is None:
        return {}
    return {
        RECONCILE_ENTRY: {
            "task": RECONCILE_TASK,
            "schedule": parse_crontab(reconcile_at),
            # A run that waited this long in the queue is stale; the next night's run is due.
            "options": {"expires": 12 * 3600},
        }
    }


def create_shop_app(
    settings: Settings | None = None,
    *,
    reconcile_at: str | None = DEFAULT_RECONCILE_AT,
    **conf: Any,
) -> Celery:
    """The shop's app from `settings` (default: JOBFENCE_*); `reconcile_at` moves the nightly
    reconciliation (None drops it), `conf` overrides Celery settings."""
    app = create_app(
        settings, include=SHOP_MODULES, beat_schedule=shop_beat_schedule(reconcile_at), **conf
    )
    journal.connect(runtime_for(app))  # the demo's execution journal, when its URL is set
    return app


def __getattr__(name: str) -> Any:
    """`app` for `celery -A demo.app`: built from the environment on first access, so that
    importing this module (the demo does) reads no setting."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        app = create_shop_app()
    except UnsafeSettings as exc:
        print(f"jobfence: refusing to start: unsafe settings\n  - {exc}", file=sys.stderr)
        raise SystemExit(EX_CONFIG) from None
    globals()["app"] = app
    return app
