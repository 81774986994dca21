"""The Celery shell's one table from executor outcome to Celery action covers every status."""

from __future__ import annotations

from typing import get_args

from jobfence.tasks.celery_task import SingletonTask
from jobfence.tasks.executor import Status


def test_every_status_has_exactly_one_action() -> None:
    # A status added to the executor and not to the table fails here, not in production.
    assert set(SingletonTask.ACTIONS) == set(get_args(Status))


def test_every_action_is_a_method_of_the_task() -> None:
    for status, action in SingletonTask.ACTIONS.items():
        assert getattr(SingletonTask, action.__name__) is action, status
