"""The publish claim's cleanup after a failed run never replaces the task's own error."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from jobfence.tasks import runtime_for
from jobfence.tasks.executor import JobSpec
from tests.servers import RedisServer
from tests.tasks.conftest import AppFactory, unique
from tests.tasks.test_singleton_task import define


class BodyFailed(Exception):
    """The task's own error: the one its caller must see."""


@pytest.mark.parametrize(
    "options",
    [
        # The claim dropped so that a failed job may be sent afresh.
        pytest.param({}, id="owner-checked-clear"),
        # The started claim given back, owner-checked.
        pytest.param({"unique_for": 30.0}, id="swap_publish"),
    ],
)
def test_a_paused_lock_server_at_the_claim_cleanup_leaves_the_task_error(
    make_app: AppFactory,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    options: dict[str, Any],
) -> None:
    """The body fails and its FAILED record is stored; then the lock server stops answering
    (paused from the executor's "failed" event, just before the cleanup): the caller gets
    BodyFailed, not BackendUnavailable, and the cleanup's failure is logged once."""
    app = make_app(socket_timeout=0.3)
    calls: list[str] = []

    def body(x: str) -> None:
        calls.append(x)
        raise BodyFailed("fails by design")

    task = define(app, body, dedupe_on_publish=True, **options)

    def pause_at_failure(event: str, _spec: JobSpec, _fence: int | None) -> None:
        if event == "failed":
            redis_server.pause()

    runtime_for(app).executor.observers.append(pause_at_failure)
    caplog.set_level(logging.WARNING, logger="jobfence.tasks.celery_task")
    try:
        with pytest.raises(BodyFailed):
            task.apply((unique("n"),), throw=True).get()
    finally:
        redis_server.resume()
    assert len(calls) == 1
    notes = [r for r in caplog.records if "publish claim not cleared" in r.getMessage()]
    assert len(notes) == 1, [r.getMessage() for r in caplog.records]


def test_a_failed_copy_published_around_the_claim_leaves_the_holders_claim(
    make_app: AppFactory,
) -> None:
    """A copy that never held the key's publish claim (a workflow's duplicate goes out
    without it) fails: the claim stays with the task that holds it, so a publish meanwhile is
    still answered by that task; the holder's own failure then frees it."""
    app = make_app()

    def body(x: str) -> None:
        raise BodyFailed("fails by design")

    task = define(app, body, dedupe_on_publish=True)
    backend = runtime_for(app).backend
    n = unique("n")
    key, _ = task.identity((n,), {})
    assert backend.claim_publish(key, "holder-task", 60) is None
    with pytest.raises(BodyFailed):
        task.apply((n,), task_id="other-task", throw=True).get()
    assert backend.claim_publish(key, "third-task", 60) == "holder-task"
    with pytest.raises(BodyFailed):
        task.apply((n,), task_id="holder-task", throw=True).get()
    assert backend.claim_publish(key, "third-task", 60) is None
