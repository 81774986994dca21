"""Tasks for the workflow tests: a gated singleton head, the steps after it, a naive control.

``workflow.head`` is ``@singleton_task(key=["n"], on_conflict="skip")`` whose body records its
start and waits until the test opens the gate of job ``wf-<n>``; ``workflow.tail``,
``workflow.summary`` and ``workflow.on_error`` are plain Celery tasks that record in the Ledger
what a chain, a chord or a ``link_error`` handed them. ``workflow.naive_head`` is the control:
a plain task that skips a duplicate as the seed articles do (a ``SET NX`` lock) and returns a
marker, which the next step then takes as data.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from celery import Celery, Task

from jobfence.tasks import install, singleton_task
from tests.integration.apps.common import app_on_first_access, make_app
from tests.integration.apps.singleton_app import ledger, settings_from

__all__ = ["NAIVE_MARKER", "create_app", "fail_once_key", "job_id"]

GATE_TIMEOUT = 30.0
#: What the control's naive skip returns, as jobfence's skip did before its typed stop.
NAIVE_MARKER = {"jobfence": "duplicate"}


def job_id(n: int) -> str:
    return f"wf-{n}"


def fail_once_key(n: int) -> str:
    """Set (in the ledger's Redis) to make the next body of job n fail once at its end."""
    return f"wf-fail-once:{n}"


def _gated(self: Task, n: int) -> int:
    """Start, wait until the test opens the job's gate, end; returns n * 10."""
    book = ledger()
    book.start(job_id(n), task_id=self.request.id)
    deadline = time.monotonic() + GATE_TIMEOUT
    while not book.released(job_id(n)) and time.monotonic() < deadline:
        time.sleep(0.02)
    book.end(job_id(n), task_id=self.request.id)
    if book.client.delete(fail_once_key(n)):
        raise RuntimeError("failed once, as the test asked")
    return n * 10


def _naive_head(self: Task, n: int) -> Any:
    """The control: a duplicate is skipped with a marker as its return value."""
    client = ledger().client
    if not client.set(f"naive-lock:{n}", self.request.id, nx=True, ex=int(GATE_TIMEOUT)):
        return NAIVE_MARKER
    try:
        return _gated(self, n)
    finally:
        client.delete(f"naive-lock:{n}")


def _tail(value: Any, key: str) -> Any:
    """A chain's next step (or a `link`): records what it was handed."""
    ledger().effect(key, step="tail", received=value)
    return value


def _summary(values: list[Any], key: str) -> list[Any]:
    """A chord's body: records the header's results it was handed."""
    ledger().effect(key, step="summary", received=values)
    return values


def _on_error(task_id: str, key: str) -> None:
    """A `link_error` (old style: the failed task's id): records that it was called."""
    ledger().outcome(key, step="on_error", failed=task_id)


def _register(app: Celery) -> None:
    singleton_task(
        app=app, name="workflow.head", bind=True, shared=False, key=["n"], on_conflict="skip"
    )(_gated)
    app.task(name="workflow.naive_head", bind=True, acks_late=True, shared=False)(_naive_head)
    app.task(name="workflow.tail", shared=False)(_tail)
    app.task(name="workflow.summary", shared=False)(_summary)
    app.task(name="workflow.on_error", shared=False)(_on_error)


def create_app(env: Mapping[str, str], name: str = "workflow_app") -> Celery:
    """The Celery app with its jobfence runtime and every ``workflow.*`` task registered."""
    app = make_app(name, env)
    install(app, settings_from(env))
    _register(app)
    return app


__getattr__ = app_on_first_access(__name__, create_app)
