"""Django's tasks framework behind the gate, in one process: the backport's ImmediateBackend
wrapped by FencedBackend on a memory:// lock server, beside the same tasks unwrapped."""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("django_tasks")

from django.conf import settings as django_settings
from django.test.utils import override_settings
from django.utils.functional import empty
from django_tasks import TaskResultStatus, task

import jobfence
from jobfence.config import Settings
from jobfence.tasks import TaskDefinitionError, install
from jobfence.tasks.django_tasks import FencedBackend, FencedTask, fenced

#: The holder of the tests' jobfence runtime (FencedBackend's OPTIONS "app" names it).
LOCKS = types.SimpleNamespace()
runs: Counter[Any] = Counter()
FENCES: list[int] = []
IMMEDIATE = "django_tasks.backends.immediate.ImmediateBackend"
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
    gated = task(backend="fenced")(charge)
    assert isinstance(gated, FencedTask)
    assert isinstance(gated.get_backend(), FencedBackend)
    assert not isinstance(task(charge), FencedTask)  # the default backend is left alone


def test_the_same_job_enqueued_twice_runs_once_and_the_copy_gets_its_result() -> None:
    gated = task(backend="fenced")(charge)
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
    gated = task(backend="fenced")(charge)
    gated.enqueue(1, 10)
    gated.enqueue(2, 10)
    assert len(FENCES) == 2 and all(f > 0 for f in FENCES)


def test_key_names_the_arguments_that_make_a_job_unique() -> None:
    gated = task(backend="fenced", key="invoice_id")(charge)
    gated.enqueue(7, 100)
    other = gated.enqueue(7, 250)  # the same invoice's key with another amount: refused
    assert runs == Counter({7: 1})
    assert other.errors[0].exception_class is jobfence.IdempotencyConflict
    # Without key=, every argument counts: another amount is another job.
    everything = task(backend="fenced")(charge)
    everything.enqueue(8, 100)
    everything.enqueue(8, 250)
    assert runs[8] == 2


def test_a_copy_enqueued_while_the_job_runs_is_skipped_as_a_duplicate() -> None:
    _tasks["again"] = task(backend="fenced")(charge_and_enqueue_again)
    outer = _tasks["again"].enqueue(3)
    inner = _tasks["inner"]
    assert runs == Counter({3: 1})
    assert outer.status == TaskResultStatus.SUCCESSFUL
    assert inner.status == TaskResultStatus.FAILED
    assert inner.errors[0].exception_class is jobfence.DuplicateSkipped


def test_options_from_fenced_under_task_as_on_django_6_0() -> None:
    gated = task(backend="fenced")(marked)
    assert gated.key == ("invoice_id",) and gated.ttl == 5
    gated.enqueue(4, "first")
    gated.enqueue(4, "first")
    assert runs == Counter({4: 1})


def test_the_context_is_no_part_of_the_key_and_the_gate_sees_the_result_id() -> None:
    gated = task(backend="fenced", takes_context=True)(with_context)
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
        task(backend="fenced", **options)(charge)


def test_a_fenced_backend_without_the_backend_to_wrap_says_what_to_set() -> None:
    with pytest.raises(TaskDefinitionError, match=r"\['OPTIONS'\]\['backend'\] must name"):
        FencedBackend("fenced", {"OPTIONS": {}})
    with pytest.raises(TaskDefinitionError, match="'backend_options'"):
        FencedBackend("fenced", {"OPTIONS": {"backend": IMMEDIATE, "backend_options": {}}})
