"""A de-duplicated publish never drops the workflow it carries: the chain, link or group."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from celery import chain, group

from jobfence.tasks import DuplicatePublish, runtime_for
from jobfence.tasks.executor import STARTED
from tests.tasks.conftest import AppFactory, unique
from tests.tasks.test_singleton_task import _f, define


def _queued_ids(client: redis.Redis) -> list[str]:
    """The task ids of the messages on the broker's default queue, oldest first."""
    return [json.loads(raw)["headers"]["id"] for raw in reversed(client.lrange("celery", 0, -1))]


WORKFLOWS = {
    "chain": lambda task, tail: chain(task.s(1), tail.s()).apply_async().parent,
    "link": lambda task, tail: task.apply_async((1,), link=tail.s()),
    "link_error": lambda task, tail: task.apply_async((1,), link_error=tail.s()),
    "group": lambda task, tail: group(task.s(1), tail.s(2)).apply_async().results[0],
}


@pytest.mark.parametrize("policy", ["result", "replace"])
@pytest.mark.parametrize("workflow", list(WORKFLOWS))
def test_a_duplicate_publish_carrying_a_workflow_is_published(
    make_app: AppFactory, redis_client: redis.Redis, workflow: str, policy: str
) -> None:
    """The key is claimed by a copy already running: a plain duplicate publish answers with
    that copy's AsyncResult (nothing queued), but one carrying a workflow goes out, so the
    steps after it wait on a task id that a worker will answer (not PENDING for ever)."""
    app = make_app(eager=False)
    task = define(app, _f, dedupe_on_publish=True, on_duplicate_publish=policy)
    tail = app.task(name=unique("tests.tail"), shared=False)(_f)
    first = task.delay(1)
    key, _ = task.identity((1,), {})
    # The first copy started: its claim is marked started (it is never replaced then).
    assert runtime_for(app).backend.swap_publish(key, first.id, STARTED + first.id, 60) is None
    assert task.delay(1).id == first.id  # the control: a plain duplicate is not published
    head: Any = WORKFLOWS[workflow](task, tail)
    assert head.id != first.id
    assert head.id in _queued_ids(redis_client), "the workflow's step was never published"


def test_raise_still_refuses_a_duplicate_publish_carrying_a_workflow(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_app(eager=False)
    task = define(app, _f, dedupe_on_publish=True, on_duplicate_publish="raise")
    tail = app.task(name=unique("tests.tail"), shared=False)(_f)
    first = task.delay(1)
    with pytest.raises(DuplicatePublish) as refused:
        chain(task.s(1), tail.s()).apply_async()
    assert refused.value.task_id == first.id
    assert _queued_ids(redis_client) == [first.id]
