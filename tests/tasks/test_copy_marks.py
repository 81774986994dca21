"""The copies jobfence publishes of a delivered message carry its marks, not the broker's.

Found by the model's long run (issue 29): kombu's Redis transport (and custody) mark a
restored message `redelivered` in its headers, and every copy jobfence published of it (a
requeue behind a slot, a rate turn, a retry) inherited the flag, so each grant of each copy
counted as a crash: a job requeued five times behind a 5 s holder was dead-lettered
(PoisonMessage) though no worker had died.
"""

from __future__ import annotations

from typing import Any

from celery.app.task import Context

from jobfence.tasks import runtime_for
from jobfence.tasks.celery_spec import delivery_spec
from jobfence.tasks.flow.marks import DEFERRED_HEADER, REDELIVERIES_HEADER, Marks
from tests.tasks.conftest import AppFactory
from tests.tasks.test_singleton_task import define


def _echo(x: int) -> int:
    return x


def _request(headers: dict[str, Any]) -> Context:
    return Context({"id": "t-1", "called_directly": False, "is_eager": False,
                    "headers": headers, "delivery_info": {}})  # fmt: skip


def test_a_copy_of_a_restored_message_is_not_taken_for_a_crash(make_app: AppFactory) -> None:
    app = make_app()
    task = define(app, _echo)
    rt = runtime_for(app)
    restored = _request({"redelivered": True, "trace": "kept"})
    # Control: the restored message itself may follow a crash, and is counted so.
    assert delivery_spec(task, rt, {"x": 1}, restored).suspect
    copy_headers = Marks.read(restored.headers).copy().onto(restored.headers)
    assert "redelivered" not in copy_headers and copy_headers["trace"] == "kept"
    assert not delivery_spec(task, rt, {"x": 1}, _request(copy_headers)).suspect


def test_a_deferred_copy_is_suspect_by_its_own_mark_and_counts_carry_over() -> None:
    marks = Marks.read({REDELIVERIES_HEADER: 2, "redelivered": True})
    deferred = marks.copy(deferred=True).onto({"redelivered": True})
    assert deferred[DEFERRED_HEADER] == 1 and "redelivered" not in deferred
    again = marks.copy(redeliveries=3).onto({REDELIVERIES_HEADER: 2})
    assert again[REDELIVERIES_HEADER] == 3 and DEFERRED_HEADER not in again
