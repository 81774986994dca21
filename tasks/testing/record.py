"""What a test saw: every decision about every delivery, counted and asserted on."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jobfence.tasks.celery_task import SingletonTask
from jobfence.tasks.executor import JobSpec

#: Decisions that mean a copy of the job was absorbed: answered by the DONE record, skipped
#: as a duplicate of a running copy, throttled, or replaced before it started.
ABSORBED = frozenset({"replayed", "conflict", "throttled", "superseded_copy"})
#: How a started body can end without taking effect: stopped by a stale fence, a lost lease
#: or an error, or answered by its effects' own DONE rows ...
NO_EFFECT = frozenset({"stale", "superseded", "lease_lost", "failed", "dropped",
                       "effect_replayed"})  # fmt: skip
#: ... unless it ran to its end first (its commit refused, the lease gone): it took effect.
RAN_TO_END = frozenset({"commit_refused"})


@dataclass(frozen=True)
class Decision:
    """One thing that happened to one delivery: an executor event (started, done, replayed,
    conflict, stale, lease_lost, redeliver, ...) or, for a plain Celery task, plain_started
    and plain_done / plain_failed. `key` is the hashed job key ("" for a plain task)."""

    event: str
    task: str
    task_id: str
    key: str = ""
    fence: int | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


Trigger = Callable[[Decision], bool]  # True: done, remove it


class DecisionRecord:
    """The decisions one test saw (the executor's events, and plain Celery tasks' starts and
    ends), what they add up to, and the assertions on them."""

    def __init__(self) -> None:
        self._decisions: list[Decision] = []
        self._triggers: list[Trigger] = []
        self._lock = threading.RLock()

    # -- recording ------------------------------------------------------------------------
    @property
    def decisions(self) -> list[Decision]:
        """Every decision so far, in order."""
        with self._lock:
            return list(self._decisions)

    def decisions_for(self, task: Any, *args: Any, **kwargs: Any) -> list[Decision]:
        """The decisions about `task` whose arguments include these (none given: all)."""
        name = _task_name(task)
        return [d for d in self.decisions if d.task == name and _matches(task, d, args, kwargs)]

    def _observe(self, event: str, spec: JobSpec, fence: int | None) -> None:
        args, kwargs = _current_arguments(spec.name)
        if event == "superseded" and fence is None:
            event = "superseded_copy"  # replaced by a newer publish before it started
        self._record(Decision(event, spec.name, spec.task_id, spec.key, fence, args, kwargs))

    def _record(self, decision: Decision) -> None:
        with self._lock:
            self._decisions.append(decision)
            triggers = list(self._triggers)
        for trigger in triggers:
            if trigger(decision):
                with self._lock:
                    self._triggers.remove(trigger)

    def _on_prerun(self, task_id: str = "", task: Any = None, args: Any = None,
                   kwargs: Any = None, **_: Any) -> None:  # fmt: skip
        if task is None or isinstance(task, SingletonTask):
            return  # a jobfence task's decisions come from its executor
        self._record(Decision("plain_started", task.name, task_id or "", "", None,
                              tuple(args or ()), dict(kwargs or {})))  # fmt: skip

    def _on_postrun(self, task_id: str = "", task: Any = None, args: Any = None,
                    kwargs: Any = None, state: str | None = None, **_: Any) -> None:  # fmt: skip
        if task is None or isinstance(task, SingletonTask):
            return
        event = "plain_done" if state == "SUCCESS" else "plain_failed"
        self._record(Decision(event, task.name, task_id or "", "", None,
                              tuple(args or ()), dict(kwargs or {})))  # fmt: skip

    # -- counting -----------------------------------------------------------------------
    def runs(self, task: Any, *args: Any, **kwargs: Any) -> int:
        """How many bodies of `task` (with these arguments) started and took effect: not
        ended by a stale fence, a lost lease, a newer holder or an error, nor answered by
        their effects' own DONE rows. A body that ran to its end counts, even where its
        commit was refused afterwards (its lease gone)."""
        mine = self.decisions_for(task, *args, **kwargs)
        if not _is_jobfence(task):
            return sum(d.event == "plain_done" for d in mine)
        started = [(d.key, d.fence) for d in mine if d.event == "started"]
        ended = {(d.key, d.fence) for d in mine if d.event in NO_EFFECT}
        ended -= {(d.key, d.fence) for d in mine if d.event in RAN_TO_END}
        return sum(run not in ended for run in started)

    def absorbed(self, task: Any, *args: Any, **kwargs: Any) -> list[Decision]:
        """The copies of `task` absorbed: replayed, skipped as duplicates, throttled."""
        return [d for d in self.decisions_for(task, *args, **kwargs) if d.event in ABSORBED]

    # -- assertions -----------------------------------------------------------------------
    def assert_ran_once(self, task: Any, *args: Any, **kwargs: Any) -> None:
        """The job (these arguments of `task`) took effect exactly once."""
        n = self.runs(task, *args, **kwargs)
        if n != 1:
            raise AssertionError(
                f"{_task_name(task)}{_shown(args, kwargs)} took effect {n} times, expected "
                f"once; decisions: {self._story(task, args, kwargs)}"
            )

    def assert_absorbed(self, task: Any, *args: Any, **kwargs: Any) -> None:
        """At least one copy of the job was absorbed (replayed or skipped as a duplicate)."""
        if not self.absorbed(task, *args, **kwargs):
            raise AssertionError(
                f"no copy of {_task_name(task)}{_shown(args, kwargs)} was absorbed (replayed, "
                f"skipped as a duplicate); decisions: {self._story(task, args, kwargs)}"
            )

    def assert_stale_write_refused(self, task: Any, *args: Any, **kwargs: Any) -> None:
        """A write of the job carrying an old fence was refused (StaleFence)."""
        if not any(d.event == "stale" for d in self.decisions_for(task, *args, **kwargs)):
            raise AssertionError(
                f"no stale write of {_task_name(task)}{_shown(args, kwargs)} was refused; "
                f"decisions: {self._story(task, args, kwargs)}"
            )

    def _story(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        mine = self.decisions_for(task, *args, **kwargs)
        if not mine:
            return "none (was it called through .apply(), .delay() or a worker?)"
        return ", ".join(d.event if d.fence is None else f"{d.event}@{d.fence}" for d in mine)


# -- helpers --------------------------------------------------------------------------------
def _task_name(task: Any) -> str:
    return task if isinstance(task, str) else str(task.name)


def _is_jobfence(task: Any) -> bool:
    return isinstance(task, SingletonTask)


def _current_arguments(name: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of the delivery running in this thread (the executor's events come
    from inside the task's call, where Celery keeps its request)."""
    from celery import current_task

    task = current_task
    if task is None or getattr(task, "name", None) != name:
        return (), {}
    request = task.request
    return tuple(request.args or ()), dict(request.kwargs or {})


def _matches(task: Any, d: Decision, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the decision's arguments include `args`/`kwargs` (bound by the task's
    signature, so a positional and a keyword argument match)."""
    if not args and not kwargs:
        return True
    run = getattr(task, "run", None)
    try:
        signature = inspect.signature(run) if run is not None else None
    except (TypeError, ValueError):
        signature = None
    if signature is None:
        return d.args[: len(args)] == args and all(d.kwargs.get(k) == v for k, v in kwargs.items())
    try:
        wanted = signature.bind_partial(*args, **kwargs).arguments
        got = signature.bind_partial(*d.args, **d.kwargs).arguments
    except TypeError:
        return False
    return all(name in got and got[name] == value for name, value in wanted.items())


def _shown(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The query, as the test wrote it (the test's own values, never logged elsewhere)."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})" if parts else ""
