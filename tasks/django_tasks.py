"""Django's tasks framework (`django.tasks`, or the django-tasks backport) behind jobfence's gate.

`FencedBackend` wraps a real task backend (configured in `TASKS`): every `@task` defined on it
is a `FencedTask`, whose `call()` runs the body through the executor as `@singleton_task`
does (look up DONE, take the lease, run with the fence, commit). Options come as `@task(...)`
keywords (the backport and Django 6.1 pass them to the backend's task class) or from
`@fenced(...)` under `@task` (Django 6.0). `CeleryBackend` is a plain backend that carries
tasks to Celery workers, which the gate's unsettled outcomes come back through.

This module is the gate (`FencedTask`, `@fenced`, `FencedBackend`); CeleryBackend and its
carrier are in tasks/django_carrier.py, the framework's import in tasks/django_framework.py,
and every public name is importable from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.utils.module_loading import import_string

from jobfence.tasks.django_carrier import CARRIER, CeleryBackend
from jobfence.tasks.django_carrier import carried_task as carried_task
from jobfence.tasks.django_carrier import carrier_serializer as carrier_serializer
from jobfence.tasks.django_carrier import run_django_task as run_django_task
from jobfence.tasks.django_framework import (
    FRAMEWORK,
    BaseTaskBackend,
    Delivery,
    Task,
    delivery_now,
    task_finished,
    task_started,
)
from jobfence.tasks.errors import JobNotSettled, TaskDefinitionError
from jobfence.tasks.executor import JobSpec
from jobfence.tasks.flow.verdict import ComeBack, NotSettled, Stop, Value
from jobfence.tasks.keys import KeySelector, bind_arguments, concurrency_key, identity
from jobfence.tasks.options import (
    DEFAULTS,
    DJANGO_OPTION_NAMES,
    OPTION_NAMES,
    ConflictPolicy,
    LeaseLostPolicy,
    TaskOptions,
    add_option_attributes,
    django_options,
    refuse_unknown,
)
from jobfence.tasks.runtime import Runtime, runtime_for

__all__ = ["CARRIER", "FRAMEWORK", "CeleryBackend", "FencedBackend", "FencedTask", "fenced"]

#: Where `@fenced(...)` leaves its options on the function, for the task class to read.
OPTIONS_ATTRIBUTE = "__jobfence_options__"


@dataclass(frozen=True, slots=True, kw_only=True)
class FencedTask(Task):  # type: ignore[misc]
    """A Django task whose body runs at most once at a time per key, and takes effect once.

    Its options are `@singleton_task`'s that act at the gate (tasks/options.py,
    DJANGO_OPTION_NAMES: `key`, `ttl`, `on_conflict` (skip | wait | raise), ...), given as
    `@task(...)` keywords and kept in `jobfence_options`; each is an attribute too
    (`task.key`). The body reads the lease and fence from `jobfence.current_job()`.
    """

    jobfence_options: TaskOptions = DEFAULTS

    def __init__(self, **given: Any) -> None:
        """Django's task fields, and the gate's options (refused, with the nearest name,
        where a keyword is neither)."""
        fields = {f.name for f in dataclasses.fields(Task) if f.init}
        options = {k: given.pop(k) for k in list(given) if k not in fields}
        checked = options.pop("jobfence_options", DEFAULTS)  # dataclasses.replace() copies
        refuse_unknown("a Django task (FencedTask)", set(options) - set(OPTION_NAMES),
                       {*OPTION_NAMES, *fields}, "neither a jobfence option nor a field of "
                       "Django's Task")  # fmt: skip
        if options:
            checked = django_options(options)
        object.__setattr__(self, "jobfence_options", checked)
        Task.__init__(self, **given)  # which calls __post_init__

    def __post_init__(self) -> None:
        marked = getattr(self.func, OPTIONS_ATTRIBUTE, None)  # @fenced(...) under @task
        if marked is not None:
            object.__setattr__(self, "jobfence_options", marked)
        # The first parameter of a task that takes the context is the TaskContext.
        self.jobfence_options.check_names(self.func, bound=self.takes_context)
        Task.__post_init__(self)  # a slots dataclass: zero-argument super() cannot work

    @property
    def job_name(self) -> str:
        """The name keys are made of: the module path (a task's `name` is only its function's)."""
        return str(self.module_path)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body through the gate; a worker calls this for each delivery."""
        backend = self.get_backend()
        if not isinstance(backend, FencedBackend):
            raise TaskDefinitionError(
                f"{self.job_name} is a FencedTask on backend {self.backend!r}, which is "
                f"{type(backend).__name__}; configure TASKS[{self.backend!r}] with "
                "BACKEND 'jobfence.tasks.django_tasks.FencedBackend'"
            )
        return self._gated(backend.runtime(), args, kwargs)

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        from asgiref.sync import sync_to_async

        return await sync_to_async(self.call)(*args, **kwargs)

    def _gated(self, rt: Runtime, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        own = args[1:] if self.takes_context else args  # the context is never part of a key
        arguments = bind_arguments(
            self.func, own, kwargs, skip_first=self.takes_context, name=self.job_name
        )
        spec = self._spec(rt, arguments, delivery_now.get() or Delivery(""))
        verdict = rt.executor.deliver(spec, lambda _job: Task.call(self, *args, **kwargs))
        match verdict:  # the flow decided (tasks/flow/verdict.py); here it is carried out
            case Value(value=value):
                return value
            case Stop(error=error):
                raise error
            case ComeBack(reason=reason, fence=fence) | NotSettled(reason=reason, fence=fence):
                # No broker of its own to come back through: CeleryBackend retries on it.
                raise JobNotSettled(f"{spec.name}: {reason}; enqueue it again (same arguments, "
                                    "same key)", key=spec.key, fence=fence)  # fmt: skip

    def _spec(self, rt: Runtime, arguments: dict[str, Any], delivery: Delivery) -> JobSpec:
        s, name, o = rt.settings, self.job_name, self.jobfence_options
        key, fp = identity(rt.secret, name, arguments, selector=o.key)
        return JobSpec(
            name=name,
            key=key,
            fingerprint=fp,
            task_id=delivery.result_id,
            failed_message=s.failed_record_message,
            redeliveries=delivery.redeliveries,
            suspect=delivery.suspect,
            max_crashed=s.max_crashed_deliveries,
            concurrency_key=(
                concurrency_key(rt.secret, name, arguments, o.concurrency_key)
                if o.concurrency
                else ""
            ),
            previous=tuple(
                identity(old, name, arguments, selector=o.key) for old in rt.previous_secrets
            ),
            **o.job_fields(s),
        )


#: Each of the gate's options an attribute of the task too (`task.key`), read from its options.
add_option_attributes(FencedTask, "jobfence_options", DJANGO_OPTION_NAMES, renamed=False)


if TYPE_CHECKING:  # the keywords, for type checkers and editors; DJANGO_OPTION_NAMES

    def fenced(
        *,
        key: KeySelector = None,
        ttl: float | None = None,
        on_conflict: ConflictPolicy = "skip",
        on_lease_lost: LeaseLostPolicy = "redeliver",
        wait_timeout: float | None = None,
        result_ttl: float | None = None,
        unique_for: float | None = None,
        concurrency: int = 0,
        concurrency_key: KeySelector = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...

else:

    def fenced(**options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The gate's options for a Django task, under `@task` (for Django 6.0, whose `task()`
        takes no extra keywords); checked here, the key's names when `@task` builds the
        FencedTask."""
        refuse_unknown("@fenced", set(options) - set(OPTION_NAMES), OPTION_NAMES,
                       "not a jobfence option")  # fmt: skip
        checked = django_options(options)

        def mark(func: Callable[..., Any]) -> Callable[..., Any]:
            setattr(func, OPTIONS_ATTRIBUTE, checked)
            return func

        return mark


class _Process:
    """Holds the process's runtime when no Celery app names one (runtime_for caches on it)."""


_PROCESS = _Process()


class FencedBackend(BaseTaskBackend):  # type: ignore[misc]
    """A task backend that wraps a real one and gates every task defined on it.

    OPTIONS: `backend` (required): the dotted path of the real backend; `options`: its own
    OPTIONS; `app` (optional): the dotted path of the Celery app whose jobfence runtime (lock
    server, keeper) the gate uses; by default the wrapped backend's Celery app, else one
    runtime per process from the JOBFENCE_* settings.
    """

    task_class = FencedTask

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        options = dict(self.options)
        path = options.pop("backend", None)
        if not isinstance(path, str) or not path:
            raise TaskDefinitionError(
                f"TASKS[{alias!r}]['OPTIONS']['backend'] must name the backend to wrap, e.g. "
                "'jobfence.tasks.django_tasks.CeleryBackend'"
            )
        inner_options = options.pop("options", {})
        self._app_path = options.pop("app", None)
        if options:
            raise TaskDefinitionError(
                f"TASKS[{alias!r}]['OPTIONS'] has {sorted(options)}, which FencedBackend does "
                "not take; the wrapped backend's own options go under 'options'"
            )
        cls = import_string(path)
        if isinstance(cls, type) and issubclass(cls, FencedBackend):
            raise TaskDefinitionError(f"TASKS[{alias!r}] wraps a FencedBackend in another")
        inner_params = {**params, "OPTIONS": inner_options}
        inner_params.pop("BACKEND", None)
        self.inner: BaseTaskBackend = cls(alias=alias, params=inner_params)
        for feature in ("supports_defer", "supports_async_task", "supports_get_result",
                        "supports_priority"):  # fmt: skip
            setattr(self, feature, getattr(self.inner, feature, False))
        task_started.connect(_delivery_started, dispatch_uid="jobfence-django-tasks-started")
        task_finished.connect(_delivery_finished, dispatch_uid="jobfence-django-tasks-finished")

    def runtime(self) -> Runtime:
        """The jobfence runtime the gate runs on, built on first use."""
        app = import_string(self._app_path) if self._app_path else None
        if app is None:
            app = getattr(self.inner, "celery_app", None) or _PROCESS
        return runtime_for(app)

    def validate_task(self, task: Any) -> None:
        self.inner.validate_task(task)

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        return self.inner.enqueue(task, args, kwargs)

    async def aenqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        return await self.inner.aenqueue(task, args, kwargs)

    def get_result(self, result_id: str) -> Any:
        return self.inner.get_result(result_id)

    async def aget_result(self, result_id: str) -> Any:
        return await self.inner.aget_result(result_id)

    def check(self, **kwargs: Any) -> Any:
        return self.inner.check(**kwargs)


def _delivery_started(sender: Any, task_result: Any, **_: Any) -> None:
    """A backend's worker starts a task result: the gate takes its id (and whether it is a
    second attempt, which may follow a crash). CeleryBackend's carrier sets it itself."""
    now = delivery_now.get()
    mine = now is not None and now.result_id == task_result.id
    if isinstance(task_result.task, FencedTask) and not mine:
        attempts = len(task_result.worker_ids)
        delivery_now.set(Delivery(str(task_result.id), suspect=attempts > 1))


def _delivery_finished(sender: Any, task_result: Any, **_: Any) -> None:
    now = delivery_now.get()
    if now is not None and now.result_id == task_result.id:
        delivery_now.set(None)
