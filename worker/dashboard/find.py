"""Finding a job by what a person knows: its task name and arguments, keyed as a worker would."""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

from jobfence.worker.admin import printable
from jobfence.worker.dashboard.data import BadInput

MAX_TASK = 200  # characters of a task name
_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
_SPACE = re.compile(r"[\s,]+")
EXAMPLE = '{"invoice_id": 42} or invoice_id=42'
NO_APP = (
    "finding a job by its arguments needs your Celery app, to key them as the worker does: "
    "start the dashboard with --app proj.tasks (in Django: Dashboard(..., app=celery_app))"
)


def parse_arguments(text: str) -> tuple[list[Any], dict[str, Any]]:
    """(args, kwargs) from the form's text: a JSON object (keyword arguments), a JSON list
    (positional ones), or name=value pairs apart by spaces or commas (each value read as JSON
    where it is JSON, so 42 is a number and "42" text; else as text up to the next space).
    Errors name the field, never a value."""
    text = text.strip()
    if not text:
        return [], {}
    if text[0] in "{[":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:  # its msg names no input, only where
            raise BadInput(
                f"arguments: not valid JSON ({exc.msg} at line {exc.lineno} column "
                f"{exc.colno}); write {EXAMPLE}"
            ) from None
        if isinstance(value, dict):
            return [], value
        return list(value), {}
    kwargs: dict[str, Any] = {}
    decoder, pos, n = json.JSONDecoder(), 0, 0
    while pos < len(text):
        n += 1
        match = _NAME.match(text, pos)
        if match is None:
            raise BadInput(
                f"arguments: item {n} is not name=value (a Python name, then =); write "
                f"{EXAMPLE}, or a JSON object"
            )
        name, pos = match.group(1), match.end()
        if name in kwargs:
            raise BadInput(f"arguments: {name} is given twice (item {n})")
        if text[pos : pos + 1] in ('"', "[", "{"):  # a JSON string, list or object
            try:
                kwargs[name], pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise BadInput(f"arguments: {name} is not valid JSON ({exc.msg}); write "
                               f'{name}="text" or {name}=[1, 2]') from None  # fmt: skip
        else:
            end = _SPACE.search(text, pos)
            raw = text[pos : end.start() if end else len(text)]
            pos += len(raw)
            try:
                kwargs[name] = json.loads(raw)  # 42, 4.2, true, null
            except json.JSONDecodeError:
                kwargs[name] = raw
        space = _SPACE.match(text, pos)
        if space is None and pos < len(text):
            raise BadInput(f"arguments: put a space after {name}'s value (item {n})")
        pos = space.end() if space else pos
    return [], kwargs


def close_names(name: str, names: list[str]) -> list[str]:
    """Task names like `name`: near spellings, and those ending with or containing it."""
    near = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    tail = [t for t in names if name and (t.endswith("." + name) or name in t)]
    return list(dict.fromkeys(near + tail))[:5]


def job_key(app: Any, task_name: str, arguments: str, explicit: str = "") -> str:
    """The job key the worker computes for `task_name` called with `arguments` (the form's
    text) under the app's key secret; BadInput naming the field otherwise."""
    task = jobfence_task(app, task_name)
    task_name = task_name.strip()
    args, kwargs = parse_arguments(arguments)
    if explicit and (len(explicit) > MAX_TASK or not explicit.isprintable()):
        raise BadInput(f"idempotency key must be at most {MAX_TASK} printable characters")
    from jobfence.config.errors import UnsafeSettings
    from jobfence.tasks.errors import BadArguments

    try:
        key, _ = task.identity(args, kwargs, explicit or None)
    except BadArguments as exc:  # worded as a plain call: names, never values
        raise BadInput(f"arguments: {exc}") from None
    except UnsafeSettings as exc:
        raise BadInput(f"the app's jobfence settings are not usable here: {exc}") from None
    except Exception as exc:  # the task's own key function: its message may hold a value
        raise BadInput(
            f"arguments: the key function of {printable(task_name)} raised "
            f"{type(exc).__name__} for them; check them against the task's signature"
        ) from None
    return str(key)


def jobfence_task(app: Any, task_name: str) -> Any:
    """The app's jobfence task named `task_name` (stripped); BadInput saying what is wrong
    with the name otherwise (no app, empty, too long, unknown: with near names, a plain
    Celery task)."""
    if app is None:
        raise BadInput(NO_APP)
    task_name = task_name.strip()
    if not task_name:
        raise BadInput("task name is empty: give the task's name, e.g. shop.tasks.charge")
    if len(task_name) > MAX_TASK or not task_name.isprintable():
        raise BadInput(f"task name must be at most {MAX_TASK} printable characters")
    tasks = sorted(t for t in app.tasks if not t.startswith("celery."))
    task = app.tasks.get(task_name)
    if task is None:
        near = close_names(task_name, tasks)
        hint = (
            f"did you mean {', '.join(near)}?" if near
            else f"the app's tasks: {', '.join(tasks[:10]) or 'none'}"
        )  # fmt: skip
        raise BadInput(f"task name: the app has no task {printable(task_name)!r}; {hint}")
    if not callable(getattr(task, "identity", None)):
        raise BadInput(
            f"task name: {printable(task_name)} is a plain Celery task, not a jobfence one: "
            f"it has no job key to find"
        )
    return task
