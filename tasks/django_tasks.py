"""Django's tasks framework (`django.tasks`, or the django-tasks backport) behind jobfence's gate.

`FencedBackend` wraps a real task backend (configured in `TASKS`): every `@task` defined on it
is a `FencedTask`, whose `call()` runs the body through the executor as `@singleton_task`
does (look up DONE, take the lease, run with the fence, commit). Options come as `@task(...)`
keywords (the backport and Django 6.1 pass them to the backend's task class) or from
`@fenced(...)` under `@task` (Django 6.0). `CeleryBackend` is a plain backend that carries
tasks to Celery workers, which the gate's unsettled outcomes come back through.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import Task as CeleryTask
from celery import shared_task
from celery.utils import uuid
from django.utils import timezone
from django.utils.module_loading import import_string

# Django 6's own framework first: a Django that has it never runs the backport, even where
# the backport is installed too. The backport serves Django 4.2-5.x.
try:
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskContext, TaskResult, TaskResultStatus
    from django.tasks.signals import task_enqueued, task_finished, task_started

    FRAMEWORK = "django.tasks"  # the module the framework in use is imported from
except ImportError:
    try:
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskContext, TaskResult, TaskResultStatus
        from django_tasks.signals import task_enqueued, task_finished, task_started
    except ImportError as exc:
        raise ImportError(
            "jobfence's Django tasks support needs django.tasks (Django 6) or the backport: "
            "pip install 'jobfence[django-tasks]'"
        ) from exc
    FRAMEWORK = "django_tasks"

from jobfence.tasks.celery_task import SINGLETON_SERIALIZERS
from jobfence.tasks.errors import JobNotSettled, JobSkipped, TaskDefinitionError
from jobfence.tasks.executor import JobSpec, Redelivery
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

log = logging.getLogger(__name__)

#: The Celery task that carries a Django task to a worker (CeleryBackend).
CARRIER = "jobfence.django_task"
#: The module paths of the Django tasks defined in this process on a CeleryBackend (directly
#: or wrapped): the carrier imports what a message names only if it is one of these, or lives
#: in an installed Django app.
_CARRIED: set[str] = set()
#: Where `@fenced(...)` leaves its options on the function, for the task class to read.
OPTIONS_ATTRIBUTE = "__jobfence_options__"


@dataclass(frozen=True)
class _Delivery:
    """The task result a worker is running now: its id, and whether it may follow a crash."""

    result_id: str
    redeliveries: int = 0
    suspect: bool = False


_delivery: ContextVar[_Delivery | None] = ContextVar("jobfence_django_delivery", default=None)


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
        spec = self._spec(rt, arguments, _delivery.get() or _Delivery(""))
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

    def _spec(self, rt: Runtime, arguments: dict[str, Any], delivery: _Delivery) -> JobSpec:
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
    now = _delivery.get()
    mine = now is not None and now.result_id == task_result.id
    if isinstance(task_result.task, FencedTask) and not mine:
        attempts = len(task_result.worker_ids)
        _delivery.set(_Delivery(str(task_result.id), suspect=attempts > 1))


def _delivery_finished(sender: Any, task_result: Any, **_: Any) -> None:
    now = _delivery.get()
    if now is not None and now.result_id == task_result.id:
        _delivery.set(None)


class CeleryBackend(BaseTaskBackend):  # type: ignore[misc]
    """A task backend that sends each task to Celery workers (OPTIONS: `app`, the dotted path
    of the Celery app). The workers run the `jobfence.django_task` carrier: include
    "jobfence.tasks.django_tasks" in the app. Queue "default" is Celery's default queue."""

    supports_defer = True
    supports_async_task = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        path = self.options.get("app")
        if not isinstance(path, str) or not path:
            raise TaskDefinitionError(
                f"TASKS[{alias!r}] OPTIONS need 'app': the dotted path of your Celery app, "
                "e.g. 'proj.celery.app'"
            )
        self.celery_app = import_string(path)

    def validate_task(self, task: Any) -> None:
        """Django's own checks; then the task is one the carrier may run (_CARRIED)."""
        super().validate_task(task)
        _CARRIED.add(task.module_path)

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        self.validate_task(task)
        result = TaskResult(
            task=task,
            id=uuid(),
            status=TaskResultStatus.READY,
            enqueued_at=timezone.now(),
            started_at=None,
            last_attempted_at=None,
            finished_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        # The app's serializer where it is JSON or signed JSON (`auth`), as singleton tasks
        # do: a worker that accepts only signed messages drops a plain JSON one.
        options: dict[str, Any] = {"task_id": result.id, "serializer": carrier_serializer(
            self.celery_app)}  # fmt: skip
        if task.queue_name != "default":
            options["queue"] = task.queue_name
        if task.run_after is not None:
            options["eta"] = task.run_after
        self.celery_app.send_task(
            CARRIER, args=[task.module_path, result.args, result.kwargs], **options
        )
        task_enqueued.send(type(self), task_result=result)
        return result


def carrier_serializer(app: Any) -> str:
    """The serializer the carrier's messages use: the app's when JSON or `auth`, else JSON."""
    chosen = str(app.conf.task_serializer or "json")
    return chosen if chosen in SINGLETON_SERIALIZERS else "json"


class _Carrier(CeleryTask):  # type: ignore[misc]
    """The carrier's class: it follows the app's serializer like a singleton task (its
    retries are signed where the app signs)."""

    serializer: str | None = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        if cls.serializer not in SINGLETON_SERIALIZERS:
            cls.serializer = "json"


def carried_task(module_path: str) -> Any:
    """The Django task `module_path` names, checked before anything is imported: a task this
    process defined on a CeleryBackend, or one in an installed Django app's modules."""
    known = isinstance(module_path, str) and (
        module_path in _CARRIED or _in_an_app(module_path)
    )
    if not known:
        shown = repr(module_path)[:200]
        raise TaskDefinitionError(
            f"{CARRIER}: {shown} is no Django task of this worker's (not defined on a "
            "CeleryBackend here, not in an installed app): not imported; import the module "
            "that defines the task in the worker, or list its app in INSTALLED_APPS"
        )
    task = import_string(module_path)
    if not isinstance(task, Task) or task.module_path != module_path:
        raise TaskDefinitionError(f"{module_path} is no Django task (got {type(task).__name__})")
    return task


def _in_an_app(module_path: str) -> bool:
    from django.apps import apps
    from django.core.exceptions import AppRegistryNotReady

    try:
        return apps.get_containing_app_config(module_path.rpartition(".")[0]) is not None
    except AppRegistryNotReady:  # no django.setup(): only the tasks defined here
        return False


_REDELIVERY = Redelivery()


@shared_task(  # type: ignore[untyped-decorator,misc]
    base=_Carrier,
    name=CARRIER,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    throws=(JobSkipped,),  # an expected end: one log line, no traceback
    max_retries=None,  # the executor's redelivery limit bounds an unsettled job
)
def run_django_task(self: Any, module_path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Run one Django task on a Celery worker; an unsettled job comes back as a retry."""
    task = carried_task(module_path)
    req = self.request
    info = req.delivery_info or {}
    delivery = _Delivery(req.id, req.retries, bool(info.get("redelivered")))
    token = _delivery.set(delivery)
    try:
        if task.takes_context:
            return task.call(TaskContext(task_result=_running(task, req, args, kwargs)),
                             *args, **kwargs)  # fmt: skip
        return task.call(*args, **kwargs)
    except JobNotSettled as exc:
        log.warning("%s[%s] comes back later: %s", module_path, req.id, type(exc).__name__)
        raise self.retry(exc=exc, countdown=_REDELIVERY.delay(req.retries)) from None
    finally:
        _delivery.reset(token)


def _running(task: Any, req: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    now = timezone.now()
    return TaskResult(
        task=task,
        id=req.id,
        status=TaskResultStatus.RUNNING,
        enqueued_at=None,
        started_at=now,
        last_attempted_at=now,
        finished_at=None,
        args=args,
        kwargs=kwargs,
        backend=task.backend,
        errors=[],
        worker_ids=[str(req.hostname)] * (req.retries + 1),
    )
