"""Django tasks carried to Celery workers: CeleryBackend, the carrier task that runs them, and
the check of what a message may make the carrier import."""

from __future__ import annotations

import difflib
import logging
from typing import Any

from celery import Task as CeleryTask
from celery import shared_task
from celery.utils import uuid
from django.utils import timezone
from django.utils.module_loading import import_string

from jobfence.tasks.celery_task import SINGLETON_SERIALIZERS
from jobfence.tasks.django_framework import (
    BaseTaskBackend,
    Delivery,
    Task,
    TaskContext,
    TaskResult,
    TaskResultStatus,
    delivery_now,
    task_enqueued,
)
from jobfence.tasks.errors import JobNotSettled, JobSkipped, TaskDefinitionError
from jobfence.tasks.executor import Redelivery

#: The Django shell's logger, named as before the shell was split in files.
log = logging.getLogger("jobfence.tasks.django_tasks")

#: The Celery task that carries a Django task to a worker (CeleryBackend).
CARRIER = "jobfence.django_task"
#: The module paths of the Django tasks defined in this process on a CeleryBackend (directly
#: or wrapped): the carrier imports what a message names only if it is one of these, or lives
#: in an installed Django app.
_CARRIED: set[str] = set()


class CeleryBackend(BaseTaskBackend):  # type: ignore[misc]
    """A task backend that sends each task to Celery workers. The workers run the
    `jobfence.django_task` carrier: include "jobfence.tasks.django_tasks" in the app. Queue
    "default" is Celery's default queue.

    OPTIONS: `app` (required), the dotted path of the Celery app; `enqueue_on_commit`
    (default False): an `enqueue()` writes its message to the outbox table in the caller's
    transaction on the database `using` (default "default") and publishes it once that
    commits; a rollback sends nothing, and the fleet's outbox relay sends what a dead
    process or a stopped broker left unsent (tasks/outbox.py, docs/how-to/django-tasks.md).
    """

    supports_defer = True
    supports_async_task = True
    #: The OPTIONS this backend takes.
    OPTION_NAMES = ("app", "enqueue_on_commit", "using")

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        unknown = sorted(set(self.options) - set(self.OPTION_NAMES))
        if unknown:
            near = difflib.get_close_matches(unknown[0], self.OPTION_NAMES, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TaskDefinitionError(
                f"TASKS[{alias!r}]['OPTIONS'] has {unknown}, which CeleryBackend does not "
                f"take (it takes {', '.join(self.OPTION_NAMES)}){hint}"
            )
        path = self.options.get("app")
        if not isinstance(path, str) or not path:
            raise TaskDefinitionError(
                f"TASKS[{alias!r}] OPTIONS need 'app': the dotted path of your Celery app, "
                "e.g. 'proj.celery.app'"
            )
        on_commit = self.options.get("enqueue_on_commit", False)
        using = self.options.get("using")
        if not isinstance(on_commit, bool):
            raise TaskDefinitionError(
                f"TASKS[{alias!r}]['OPTIONS']['enqueue_on_commit'] must be True or False, "
                f"not {type(on_commit).__name__}"
            )
        if using is not None and (not isinstance(using, str) or not using):
            raise TaskDefinitionError(
                f"TASKS[{alias!r}]['OPTIONS']['using'] must name a database of DATABASES "
                "(the outbox table's), e.g. 'default'"
            )
        if using is not None and not on_commit:
            raise TaskDefinitionError(
                f"TASKS[{alias!r}]['OPTIONS']['using'] names the outbox's database, which "
                "only enqueue_on_commit uses: set 'enqueue_on_commit': True, or drop 'using'"
            )
        self.enqueue_on_commit: bool = on_commit
        self.using: str | None = using
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
        carried = [task.module_path, result.args, result.kwargs]
        if self.enqueue_on_commit:
            self._on_commit(result.id, carried, options)
        else:
            self.celery_app.send_task(CARRIER, args=carried, **options)
        task_enqueued.send(type(self), task_result=result)
        return result

    def _on_commit(self, task_id: str, carried: list[Any], options: dict[str, Any]) -> None:
        """The carrier's message to the outbox, in the caller's transaction; published once it
        commits (at once outside an atomic block: the row commits as it is written)."""
        from jobfence.tasks import outbox  # SQLAlchemy: loaded on use

        options.pop("task_id")
        eta = options.get("eta")
        if eta is not None and timezone.is_naive(eta):  # USE_TZ = False: Django's local time
            options["eta"] = timezone.make_aware(eta)
        entry = outbox.entry_of(CARRIER, carried, {}, options, task_id)
        outbox.on_commit_django(self.celery_app, entry, self.using)


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
    delivery = Delivery(req.id, req.retries, bool(info.get("redelivered")))
    token = delivery_now.set(delivery)
    try:
        if task.takes_context:
            return task.call(TaskContext(task_result=_running(task, req, args, kwargs)),
                             *args, **kwargs)  # fmt: skip
        return task.call(*args, **kwargs)
    except JobNotSettled as exc:
        log.warning("%s[%s] comes back later: %s", module_path, req.id, type(exc).__name__)
        raise self.retry(exc=exc, countdown=_REDELIVERY.delay(req.retries)) from None
    finally:
        delivery_now.reset(token)


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
