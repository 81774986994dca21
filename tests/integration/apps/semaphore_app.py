"""A fleet app whose jobs of one account run at most two at once; a control without a limit.

Built from the variables of :mod:`tests.integration.apps.singleton_app` (``BROKER_URL``,
``LEDGER_URL``, ``LOCK_URL``, ``LEASE_TTL``...). Each body counts itself in and out of its
account in the Ledger (job id ``account-<name>``: ``concurrent`` says how many bodies of that
account ran at once) and records one effect under its own job id.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from celery import Celery, Task, signals

from jobfence.tasks import current_job, install, singleton_task
from tests.integration.apps.common import app_on_first_access, make_app
from tests.integration.apps.singleton_app import ledger, settings_from

LIMIT = 2
#: How long a job waits for a slot before it is published again (the requeue path).
SLOT_WAIT = 1.0


def account_job(self: Task, account: str, job_id: str, hold: float = 0.3) -> int:
    book = ledger()
    meta = {"task_id": self.request.id, "fence": current_job().fence, "job": job_id}
    book.start(f"account-{account}", **meta)
    count = book.effect(job_id, **meta)
    time.sleep(hold)
    book.end(f"account-{account}", **meta)
    return count


def create_app(env: Mapping[str, str], name: str = "semaphore_app") -> Celery:
    app = make_app(name, env)
    install(app, settings_from(env))
    singleton_task(
        app=app, name="semaphore.account_job", bind=True, shared=False,
        concurrency=LIMIT, concurrency_key=["account"], wait_timeout=SLOT_WAIT,
    )(account_job)  # fmt: skip
    singleton_task(app=app, name="semaphore.unlimited", bind=True, shared=False)(account_job)
    return app


@signals.task_postrun.connect(weak=False)
def _record_outcome(task: Any = None, args: Any = None, state: str | None = None, **_: Any) -> None:
    """Every delivery's end under its job id: IGNORED is one published again (no slot)."""
    if getattr(task, "name", "").startswith("semaphore.") and args and len(args) > 1:
        ledger().outcome(str(args[1]), state=state)


__getattr__ = app_on_first_access(__name__, create_app)
