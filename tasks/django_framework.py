"""Django's tasks framework as jobfence imports it (Django 6's own, else the backport), and
the delivery a worker is running now, which the gate and the carriers share."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

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


__all__ = [
    "FRAMEWORK",
    "BaseTaskBackend",
    "Delivery",
    "Task",
    "TaskContext",
    "TaskResult",
    "TaskResultStatus",
    "delivery_now",
    "task_enqueued",
    "task_finished",
    "task_started",
]


@dataclass(frozen=True)
class Delivery:
    """The task result a worker is running now: its id, and whether it may follow a crash."""

    result_id: str
    redeliveries: int = 0
    suspect: bool = False


#: Set by the worker side (a backend's `task_started` signal, CeleryBackend's carrier); read
#: by the gate (FencedTask) for the delivery's task id and whether it may follow a crash.
delivery_now: ContextVar[Delivery | None] = ContextVar("jobfence_django_delivery", default=None)
