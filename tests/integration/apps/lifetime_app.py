"""Tasks for the lock-lifetime and duplicate-publish tests, plus a plain Celery control task.

Built from the variables of :mod:`tests.integration.apps.singleton_app` (same broker, lock
server and ledger). Each body records its start (with its task id and `version` argument)
and end in the Ledger, waiting at the job's gate in between where the test needs a job that
is running; every delivery's state and return value go to the job's ``outcomes``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery, Task, signals

from jobfence.tasks import SingletonTask, current_job, install, singleton_task
from tests.integration.apps.common import app_on_first_access, make_app
from tests.integration.apps.singleton_app import ledger, settings_from

__all__ = ["UNIQUE_FOR", "create_app"]

#: The throttle window of ``lifetime.throttle``, in seconds.
UNIQUE_FOR = 2.0
#: How long a gated body waits for the test to open its gate.
GATE_TIMEOUT = 30.0
#: ``lifetime.slot``: how long a job waits for the only slot before it is published again.
SLOT_WAIT = 1.0
#: ``lifetime.rate``: one start per 4 s, so a second job sleeps in the worker for its turn.
RATE = "15/m"
#: ``lifetime.queue_*``: the lease TTL, far shorter than the run a newer copy waits behind.
SHORT_TTL = 1.0
#: ``lifetime.debounce``: the quiet period of a burst.
DEBOUNCE = 0.5


def gated(self: Task, job_id: str, version: str = "") -> str:
    """Start, wait until the test opens the job's gate, end; returns its `version`."""
    book = ledger()
    meta = {"task_id": self.request.id, "version": version, "pid": os.getpid()}
    book.start(job_id, **meta)
    deadline = time.monotonic() + GATE_TIMEOUT
    while not book.released(job_id) and time.monotonic() < deadline:
        time.sleep(0.02)
    book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return version


def gated_checked(self: Task, job_id: str, version: str = "") -> str:
    """`gated`, looking at its lease while it waits (a cooperative body): a run whose key a
    newer publish took (on_conflict="supersede") stops at `check()`."""
    book = ledger()
    meta = {"task_id": self.request.id, "version": version, "pid": os.getpid()}
    book.start(job_id, **meta)
    job = current_job()
    deadline = time.monotonic() + GATE_TIMEOUT
    while not book.released(job_id) and time.monotonic() < deadline:
        job.check()
        time.sleep(0.02)
    book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return version


def versioned(self: Task, job_id: str, version: str = "") -> str:
    """Start, have the effect, end; returns its `version`."""
    book = ledger()
    meta = {"task_id": self.request.id, "version": version}
    book.start(job_id, **meta)
    book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return version


def gated_then_retried(self: Task, job_id: str, version: str = "") -> str:
    """`gated`, then on the first try a retry at once."""
    out = gated(self, job_id, version)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return out


def record(self: Task, job_id: str) -> int:
    """Start, have the effect, end."""
    book = ledger()
    meta = {"task_id": self.request.id}
    book.start(job_id, **meta)
    count = book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return count


def retried(self: Task, job_id: str) -> int:
    """Retry once at once, then record (a retry publishes under the started job's task id)."""
    book = ledger()
    book.start(job_id, task_id=self.request.id, retries=self.request.retries)
    book.end(job_id, task_id=self.request.id)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return book.effect(job_id, task_id=self.request.id)


def _register(app: Celery) -> None:
    def singleton(name: str, body: Any, **options: Any) -> None:
        singleton_task(
            app=app, name=name, bind=True, shared=False, key=["job_id"], **options
        )(body)

    singleton(
        "lifetime.start",
        gated,
        dedupe_on_publish=True,
        lock_until="start",
        on_conflict="wait",
        wait_timeout=GATE_TIMEOUT,
    )
    # lock_until="start" meeting a slot, a rate turn and a running copy of the key.
    start = {"dedupe_on_publish": True, "lock_until": "start"}
    singleton("lifetime.slot", gated, **start, on_conflict="wait", wait_timeout=SLOT_WAIT,
              concurrency=1)  # fmt: skip
    singleton("lifetime.rate", gated, **start, on_conflict="wait", global_rate_limit=RATE,
              on_rate_limited="wait", wait_timeout=GATE_TIMEOUT)  # fmt: skip
    singleton("lifetime.queue_retry", gated, **start, on_conflict="retry", ttl=SHORT_TTL)
    singleton("lifetime.queue_wait", gated, **start, on_conflict="wait", ttl=SHORT_TTL,
              wait_timeout=SHORT_TTL * 2)  # fmt: skip
    singleton("lifetime.start_retried", gated_then_retried, **start, on_conflict="wait",
              wait_timeout=GATE_TIMEOUT, max_retries=2)  # fmt: skip
    singleton("lifetime.finish", gated, dedupe_on_publish=True)
    # lock_until="finish": a duplicate delivery waits behind the long run of the same job.
    singleton("lifetime.behind_retry", gated, on_conflict="retry", ttl=SHORT_TTL)
    singleton("lifetime.behind_wait", gated, on_conflict="wait", ttl=SHORT_TTL,
              wait_timeout=SHORT_TTL * 2)  # fmt: skip
    singleton("lifetime.throttle", record, dedupe_on_publish=True, unique_for=UNIQUE_FOR)
    singleton("lifetime.retried", retried, dedupe_on_publish=True, unique_for=UNIQUE_FOR,
              max_retries=1)  # fmt: skip
    singleton("lifetime.raise", gated, dedupe_on_publish=True, on_duplicate_publish="raise")
    singleton("lifetime.replace", gated, dedupe_on_publish=True, on_duplicate_publish="replace")
    # Issue 34: the newest publish takes the key from the running copy; a debounced burst.
    singleton("lifetime.supersede", gated_checked, on_conflict="supersede", ttl=SHORT_TTL * 1.5)
    singleton("lifetime.debounce", versioned, debounce=DEBOUNCE, debounce_max_wait=2.0)
    # The control: plain Celery, the same body, no jobfence.
    app.task(name="lifetime.plain", bind=True, acks_late=True, shared=False)(gated)


def create_app(env: Mapping[str, str], name: str = "lifetime_app") -> Celery:
    """The Celery app with its jobfence runtime and every ``lifetime.*`` task registered."""
    app = make_app(name, env)
    install(app, settings_from(env))
    _register(app)
    return app


@signals.task_postrun.connect(weak=False)
def _record_outcome(
    task_id: str | None = None,
    task: Any = None,
    args: Any = None,
    retval: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    name = getattr(task, "name", "") or ""
    if not name.startswith("lifetime.") or not args:
        return
    info: dict[str, Any] = {"task_id": task_id, "task": name, "state": state}
    info["value" if state == "SUCCESS" else "error"] = (
        retval if state == "SUCCESS" else type(retval).__name__
    )
    info["singleton"] = isinstance(task, SingletonTask)
    ledger().outcome(str(args[0]), **info)


__getattr__ = app_on_first_access(__name__, create_app)
