"""A delivery with no result of its own raises a typed stop, in eager mode and direct calls."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery, chain
from celery.app.task import Context
from celery.backends.base import Backend

from jobfence.tasks import (
    DROPPED,
    DUPLICATE,
    SUPERSEDED,
    DuplicateJob,
    DuplicateSkipped,
    JobDropped,
    JobSkipped,
    JobSuperseded,
    Outcome,
    RateLimitSkipped,
    runtime_for,
)
from jobfence.tasks.executor import RATE_SKIPPED, JobSpec
from jobfence.tasks.flow.job import Job
from jobfence.tasks.flow.verdict import ComeBack, Stop, Value, Verdict
from tests.tasks.conftest import AppFactory, spec_for, unique
from tests.tasks.test_singleton_task import define, occupy


def _times_ten(n: int) -> int:
    return n * 10


def _recorder(app: Celery, received: list[Any]) -> Any:
    """A plain Celery task that records what it is given: a chain's next step."""

    def tail(value: Any) -> Any:
        received.append(value)
        return value

    return app.task(name=unique("tests.tail"), shared=False)(tail)


def test_eager_chain_stops_at_a_duplicate_and_never_passes_the_marker_on(
    make_app: AppFactory,
) -> None:
    app = make_app()
    received: list[Any] = []
    head = define(app, _times_ten, key=["n"], on_conflict="skip")
    tail = _recorder(app, received)
    occupy(app, head, (7,))
    with pytest.raises(DuplicateSkipped):
        chain(head.s(7), tail.s()).apply_async()
    assert received == []


def test_eager_chain_gets_the_real_result_once_the_job_is_done(make_app: AppFactory) -> None:
    app = make_app()
    received: list[Any] = []
    head = define(app, _times_ten, key=["n"], on_conflict="skip")
    tail = _recorder(app, received)
    assert chain(head.s(7), tail.s()).apply_async().get() == 70
    assert chain(head.s(7), tail.s()).apply_async().get() == 70  # replayed from DONE
    assert received == [70, 70]


def test_direct_call_of_a_duplicate_raises_duplicate_skipped(make_app: AppFactory) -> None:
    app = make_app()
    head = define(app, _times_ten, key=["n"], on_conflict="skip")
    occupy(app, head, (4242421,))
    with pytest.raises(DuplicateSkipped) as caught:
        head(4242421)
    assert isinstance(caught.value, DuplicateJob) and isinstance(caught.value, JobSkipped)
    assert caught.value.marker == DUPLICATE
    assert caught.value.task_id == "elsewhere"  # the holder's: its AsyncResult answers
    assert "4242421" not in str(caught.value)  # names no argument


@pytest.mark.parametrize(
    ("outcome", "stop"),
    [
        (Outcome("duplicate", DUPLICATE), DuplicateSkipped),
        (Outcome("superseded", SUPERSEDED), JobSuperseded),
        (Outcome("dropped", DROPPED, fence=3), JobDropped),
        (Outcome("rate_skipped", {**RATE_SKIPPED, "retry_after": 2.5}), RateLimitSkipped),
    ],
)
def test_every_marker_outcome_becomes_its_typed_stop(
    make_app: AppFactory, outcome: Outcome, stop: type[JobSkipped]
) -> None:
    verdict = _verdict(make_app(), spec_for(unique("job")), outcome)
    assert isinstance(verdict, Stop) and type(verdict.error) is stop
    assert verdict.error.marker == {"jobfence": outcome.value["jobfence"]}


def _verdict(app: Celery, spec: JobSpec, outcome: Outcome) -> Verdict:
    """The flow's verdict on `outcome`, on the app's own lock server."""
    executor = runtime_for(app).executor
    job = Job(spec, backoff=executor.backoff, redelivery=executor.redelivery)
    return executor._drive(job, job.verdict(outcome), None)


def test_ran_and_replayed_outcomes_pass_their_value(make_app: AppFactory) -> None:
    app = make_app()
    spec = spec_for(unique("job"))
    assert _verdict(app, spec, Outcome("ran", {"jobfence": "mine"})) == Value({"jobfence": "mine"})
    assert _verdict(app, spec, Outcome("replayed", 5)) == Value(5)


def test_a_superseded_copy_answers_with_the_jobs_done_record(make_app: AppFactory) -> None:
    app = make_app()
    head = define(app, _times_ten, key=["n"])
    assert head(7) == 70  # the newer holder's run: its DONE record is this job's result
    key, fp = head.identity((7,), {})
    spec = spec_for(key, name=head.name, fingerprint=fp)
    answered = _verdict(app, spec, Outcome("superseded", SUPERSEDED))
    assert isinstance(answered, Value) and answered.value == 70
    other = spec_for(key, name=head.name, fingerprint=fp + "-other-arguments")
    stopped = _verdict(app, other, Outcome("superseded", SUPERSEDED))
    assert isinstance(stopped, Stop) and isinstance(stopped.error, JobSuperseded)


@pytest.mark.parametrize(
    "exc",
    [
        DuplicateSkipped("t: duplicate", "holder-id", key="k"),
        JobSuperseded("t: superseded"),
        JobDropped("t: dropped"),
        RateLimitSkipped("t: rate", 2.5, key="k"),
    ],
)
def test_a_stop_survives_the_json_result_backend(make_app: AppFactory, exc: JobSkipped) -> None:
    backend = Backend(make_app(), serializer="json")
    stored = backend.prepare_exception(exc)
    back = backend.exception_to_python(backend.decode(backend.encode(stored)))
    assert type(back) is type(exc) and str(back) == str(exc)
    if isinstance(exc, RateLimitSkipped):
        assert isinstance(back, RateLimitSkipped) and back.retry_after == 2.5
    if isinstance(exc, DuplicateSkipped):
        assert isinstance(back, DuplicateSkipped) and back.task_id == "holder-id"


@pytest.mark.parametrize(
    ("fields", "spec_options", "follows"),
    [
        ({"chain": [{"task": "next"}]}, {}, True),
        ({"callbacks": [{"task": "next"}]}, {}, True),
        ({"chord": {"task": "body"}}, {}, True),
        ({"group": "g-1"}, {}, True),
        ({}, {}, False),  # no workflow after it: the typed stop is enough
        ({"chain": [{"task": "next"}], "is_eager": True}, {}, False),  # no broker to return
        ({"chain": [{"task": "next"}]}, {"unique_for": 5.0}, False),  # a run of its own
        ({"chain": [{"task": "next"}]}, {"lock_until": "start"}, False),
    ],
)
def test_a_skipped_duplicate_follows_the_running_copy_only_inside_a_workflow(
    make_app: AppFactory, fields: dict[str, Any], spec_options: dict[str, Any], follows: bool
) -> None:
    app = make_app()
    req = Context({"id": "dup", "called_directly": False, "is_eager": False, **fields})
    # What the Celery shell reads off the request for the spec (tasks/celery_task.py)
    spec = spec_for(unique("job"), task_id="dup", on_conflict="skip",
                    queues=not (req.called_directly or req.is_eager),
                    in_workflow=bool(req.callbacks or req.chain or req.chord or req.group),
                    **spec_options)  # fmt: skip
    known = _verdict(app, spec, Outcome("duplicate", DUPLICATE, holder="running"))
    assert isinstance(known, ComeBack) is follows
    assert isinstance(known, Stop) is not follows
    unknown = _verdict(app, spec, Outcome("duplicate", DUPLICATE))  # no copy known: no follow
    assert isinstance(unknown, Stop)
