"""The keywords Celery's `app.task` takes besides a task class's attributes, read from Celery."""

from __future__ import annotations

import dis
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.app import autoretry
from celery.app.task import extract_exec_options


@functools.cache
def celery_keywords() -> frozenset[str]:
    """The keywords Celery takes besides a task class's attributes, read from Celery itself:
    `_task_from_fun`'s parameters, `app.task`'s own (shared, filter, lazy), the autoretry
    options, and the execution options a task class may carry (queue, routing_key, ...)."""
    names = set(inspect.signature(Celery._task_from_fun).parameters) - {"self", "fun", "options"}
    names |= _nested_parameters(Celery.task, "inner_create_task_cls") or {"shared", "filter",
                                                                          "lazy"}  # fmt: skip
    names |= _options_read(autoretry.add_autoretry_behaviour) or set(_AUTORETRY)
    names |= set(extract_exec_options(types.SimpleNamespace()))
    return frozenset(names)


#: Celery 5's autoretry options, should its code stop showing them (a fallback only).
_AUTORETRY = ("autoretry_for", "dont_autoretry_for", "retry_kwargs", "retry_backoff",
              "retry_backoff_max", "retry_jitter")  # fmt: skip


def _nested_parameters(func: Callable[..., Any], inner: str) -> set[str]:
    """The parameters of the function `inner` defined inside `func`."""
    for const in func.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == inner:
            return set(const.co_varnames[: const.co_argcount + const.co_kwonlyargcount])
    return set()


def _options_read(func: Callable[..., Any]) -> set[str]:
    """The names `func` reads with `options.get("name", ...)`."""
    found, steps = set(), list(dis.get_instructions(func))
    for a, b, c in zip(steps, steps[1:], steps[2:], strict=False):
        if a.argval == "options" and b.argval == "get" and isinstance(c.argval, str):
            found.add(c.argval)
    return found
