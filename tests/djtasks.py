"""The Django tasks framework the suite runs on: Django 6's django.tasks, else the backport."""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

from jobfence.tasks import django_tasks

#: "django.tasks" or "django_tasks": the path jobfence took (tests/test_django_tasks_path.py).
FRAMEWORK: str = django_tasks.FRAMEWORK
framework = importlib.import_module(FRAMEWORK)
task: Any = framework.task
TaskResultStatus: Any = framework.TaskResultStatus
IMMEDIATE = f"{FRAMEWORK}.backends.immediate.ImmediateBackend"
#: Whether `task()` hands extra keywords to the backend's task class (the backport, Django
#: 6.1 and later); Django 6.0's takes none, so the gate's options go through `@fenced`.
KEYWORDS = any(
    p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(task).parameters.values()
)


def gate_task(
    func: Callable[..., Any],
    *,
    backend: str = "fenced",
    takes_context: bool = False,
    **options: Any,
) -> Any:
    """`func` as a task on `backend` with the gate's `options`: as `task()` keywords where the
    framework passes them on, else (Django 6.0) through `@fenced` on a copy of `func`, so that
    the module's function keeps no options for the next test."""
    if not options or KEYWORDS:
        return task(backend=backend, takes_context=takes_context, **options)(func)
    copy = types.FunctionType(
        func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    copy.__qualname__, copy.__module__ = func.__qualname__, func.__module__
    copy.__kwdefaults__ = func.__kwdefaults__
    marked = django_tasks.fenced(**options)(copy)
    return task(backend=backend, takes_context=takes_context)(marked)
