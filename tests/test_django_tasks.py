"""Django's tasks framework behind the gate, in one process: its ImmediateBackend (Django 6's
or the backport's, tests/djtasks.py) wrapped by FencedBackend on a memory:// lock server,
beside the same tasks unwrapped."""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "jobfence.tasks.django_tasks", reason="needs django.tasks (Django 6) or the backport"
)

from django.conf import settings as django_settings
from django.test.utils import override_settings
from django.utils.functional import empty

import jobfence
from jobfence.config import Settings
from jobfence.tasks import TaskDefinitionError, install
from jobfence.tasks.django_tasks import FencedBackend, FencedTask, fenced
from tests.djtasks import IMMEDIATE, KEYWORDS, TaskResultStatus, gate_task, task

#: The holder of the tests' jobfence runtime (FencedBackend's OPTIONS "app" names it).
LOCKS = types.SimpleNamespace()
runs: Counter[Any] = Counter()
FENCES: list[int] = []
TASKS = {
    "default": {"BACKEND": IMMEDIATE},
    "fenced": {
        "BACKEND": "jobfence.tasks.django_tasks.FencedBackend",
        "OPTIONS": {"backend": IMMEDIATE, "app": f"{__name__}.LOCKS"},
    },
}


def charge(invoice_id: int, amount: int) -> dict[str, int]:
    runs[invoice_id] += 1
    FENCES.append(jobfence.current_job().fence)
    return {"invoice_id": invoice_id, "charged": amount}


def charge_and_enqueue_again(invoice_id: int) -> int:
    """Enqueues its own job while it runs: that copy meets the running one at the gate."""
    runs[invoice_id] += 1
    inner = _tasks["again"].enqueue(invoice_id)
    _tasks["inner"] = inner
    return invoice_id


def with_context(context: Any, invoice_id: int) -> str:
    runs[invoice_id] += 1
    return str(context.task_result.id)


@fenced(key="invoice_id", ttl=5)
def marked(invoice_id: int, note: str) -> int:
    runs[invoice_id] += 1
    return invoice_id


_tasks: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def django_configured() -> Iterator[None]:
    """Settings for these tests only: configured here (no django.setup(), no apps) and
    unconfigured after, so a later module in this process configures Django its own way."""
    mine = not django_settings.configured
    if mine:
        django_settings.configure(USE_TZ=True)
    yield
    if mine:
        django_settings._wrapped = empty


@pytest.fixture(autouse=True)
def fenced_tasks(django_configured: None) -> Iterator[None]:
    install(LOCKS, Settings(lock_url="memory://", key_secret="django-tasks-test-secret-0123456789"))
    runs.clear()
    FENCES.clear()
    with override_settings(TASKS=TASKS):
        yield
    LOCKS.jobfence_runtime.close()


def test_a_task_defined_on_the_fenced_backend_is_a_fenced_task() -> None:
    gated = gate_task(charge)
    assert isinstance(gated, FencedTask)
    assert isinstance(gated.get_backend(), FencedBackend)
    assert not isinstance(task(charge), FencedTask)  # the default backend is left alone


def test_the_same_job_enqueued_twice_runs_once_and_the_copy_gets_its_result() -> None:
    gated = gate_task(charge)
    first, second = gated.enqueue(7, 100), gated.enqueue(7, 100)
    assert runs == Counter({7: 1})
    assert first.status == second.status == TaskResultStatus.SUCCESSFUL
    assert second.return_value == first.return_value == {"invoice_id": 7, "charged": 100}


def test_without_the_gate_the_same_job_runs_twice() -> None:
    plain = task(charge)  # the control: ImmediateBackend alone
    plain.enqueue(7, 100)
    plain.enqueue(7, 100)
    assert runs == Counter({7: 2})


def test_the_body_sees_its_fence() -> None:
    gated = gate_task(charge)
    gated.enqueue(1, 10)
    gated.enqueue(2, 10)
    assert len(FENCES) == 2 and all(f > 0 for f in FENCES)


def test_key_names_the_arguments_that_make_a_job_unique() -> None:
    gated = gate_task(charge, key="invoice_id")
    gated.enqueue(7, 100)
    other = gated.enqueue(7, 250)  # the same invoice's key with another amount: refused
    assert runs == Counter({7: 1})
    assert other.errors[0].exception_class is jobfence.IdempotencyConflict
    # Without key=, every argument counts: another amount is another job.
    everything = gate_task(charge)
    everything.enqueue(8, 100)
    everything.enqueue(8, 250)
    assert runs[8] == 2


def test_a_copy_enqueued_while_the_job_runs_is_skipped_as_a_duplicate() -> None:
    _tasks["again"] = gate_task(charge_and_enqueue_again)
    outer = _tasks["again"].enqueue(3)
    inner = _tasks["inner"]
    assert runs == Counter({3: 1})
    assert outer.status == TaskResultStatus.SUCCESSFUL
    assert inner.status == TaskResultStatus.FAILED
    assert inner.errors[0].exception_class is jobfence.DuplicateSkipped


def test_options_from_fenced_under_task_as_on_django_6_0() -> None:
    gated = gate_task(marked)
    assert gated.key == ("invoice_id",) and gated.ttl == 5
    gated.enqueue(4, "first")
    gated.enqueue(4, "first")
    assert runs == Counter({4: 1})


def test_the_context_is_no_part_of_the_key_and_the_gate_sees_the_result_id() -> None:
    gated = gate_task(with_context, takes_context=True)
    first = gated.enqueue(5)
    second = gated.enqueue(5)
    assert runs == Counter({5: 1})
    assert second.return_value == first.return_value == first.id


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"on_conflict": "retry"}, "'retry' is a Celery retry"),
        ({"key": "invoice"}, "did you mean 'invoice_id'?"),
        ({"ttl": 0}, "ttl must be positive seconds"),
        ({"concurrency_key": "invoice_id"}, "add concurrency=N"),
    ],
)
def test_bad_options_are_refused_at_definition(options: dict[str, Any], message: str) -> None:
    with pytest.raises(TaskDefinitionError, match=message):
        gate_task(charge, **options)


def test_the_issues_typos_are_refused_naming_each_keyword_and_the_nearest_option() -> None:
    typos: dict[str, Any] = {"on_conflit": "raise", "dedupe_on_pubish": True}
    spellings = [lambda: fenced(key=["invoice_id"], **typos)]  # every Django with tasks
    if KEYWORDS:  # task() hands its keywords on (the backport, Django 6.1+; not 6.0)
        spellings.append(lambda: task(backend="fenced", key=["invoice_id"], **typos)(charge))
    for spelled in spellings:
        with pytest.raises(TaskDefinitionError) as refused:
            spelled()
        message = str(refused.value)
        assert "'on_conflit' (did you mean 'on_conflict'?)" in message
        assert "'dedupe_on_pubish' (did you mean 'dedupe_on_publish'?)" in message


def test_control_spelled_right_the_options_are_taken_and_kept_by_using() -> None:
    gated = gate_task(charge, key=["invoice_id"], on_conflict="raise")
    assert (gated.key, gated.on_conflict) == (("invoice_id",), "raise")
    assert gated.using(priority=5).jobfence_options == gated.jobfence_options


@pytest.mark.parametrize("option", ["dedupe_on_publish", "lock_until", "global_rate_limit"])
def test_an_option_that_acts_at_publish_is_refused_saying_so(option: str) -> None:
    value = {"dedupe_on_publish": True, "lock_until": "start", "global_rate_limit": "1/s"}
    message = f"a Django task takes no {option}: @singleton_task's options that act at publish"
    if KEYWORDS:  # task() hands its keywords on (the backport, Django 6.1+; not 6.0)
        with pytest.raises(TaskDefinitionError, match=message):
            task(backend="fenced", **{option: value[option]})(charge)
    with pytest.raises(TaskDefinitionError, match=message):
        fenced(**{option: value[option]})


def test_a_fenced_backend_without_the_backend_to_wrap_says_what_to_set() -> None:
    with pytest.raises(TaskDefinitionError, match=r"\['OPTIONS'\]\['backend'\] must name"):
        FencedBackend("fenced", {"OPTIONS": {}})
    with pytest.raises(TaskDefinitionError, match="'backend_options'"):
        FencedBackend("fenced", {"OPTIONS": {"backend": IMMEDIATE, "backend_options": {}}})
