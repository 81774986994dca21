"""Testing your own tasks: a fresh in-memory lock server per test, fault helpers, assertions.

`in_memory()` (a context manager; the pytest fixture `jobfence` and `JobfenceTestCase` use
it) answers every app's runtime with one built on a fresh `memory://` lock server for as
long as it lasts: apps set up with `jobfence.setup`, apps built by a test (Celery's
`celery_app` fixture) and `@singleton_task` alone. Nothing is written to a real lock server,
and no app's own runtime is touched. Every decision the executor takes is recorded
(`Executor.observers`), and plain Celery tasks are seen through `task_prerun`/`task_postrun`,
so one test can show a naive task failing where a jobfence task passes.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import unittest
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import uuid4

from jobfence.config.schemes import backend_schemes
from jobfence.config.settings import Settings, load_settings
from jobfence.locks.backend import BeginResult
from jobfence.locks.backends.memory import MemoryBackend
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import Lease
from jobfence.tasks import runtime as runtimes
from jobfence.tasks.celery_task import SingletonTask
from jobfence.tasks.errors import JobNotSettled
from jobfence.tasks.executor import JobSpec

_log = logging.getLogger(__name__)

FaultPoint = Literal["begin", "commit"]
FAULT_POINTS: tuple[str, ...] = ("begin", "commit")

#: Decisions that mean a copy of the job was absorbed: answered by the DONE record, skipped
#: as a duplicate of a running copy, throttled, or replaced before it started.
ABSORBED = frozenset({"replayed", "conflict", "throttled", "superseded_copy"})
#: How a started body can end without taking effect: stopped by a stale fence, a lost lease
#: or an error, or answered by its effects' own DONE rows ...
NO_EFFECT = frozenset({"stale", "superseded", "lease_lost", "failed", "dropped",
                       "effect_replayed"})  # fmt: skip
#: ... unless it ran to its end first (its commit refused, the lease gone): it took effect.
RAN_TO_END = frozenset({"commit_refused"})


class LockServerForTests(MemoryBackend):
    """`memory://` with a fault switch: `fail("begin"|"commit", times)` makes that operation
    raise BackendUnavailable, as a lock server that does not answer would.

    A commit failing for good (`times=None`) is an outage that outlasts the job's lease: the
    lease's time is run out at the first refused commit (its grant expires here, its deadline
    passes in the worker), so the executor gives the commit up as of unknown outcome and the
    job is delivered again, as it would be after the TTL, without waiting for it."""

    __test__ = False  # pytest: not a test class

    def __init__(self) -> None:
        super().__init__()
        self._faults: dict[str, int | None] = {}  # op -> failures left (None: until restored)
        self._faults_lock = threading.Lock()

    def fail(self, at: FaultPoint, times: int | None = 1) -> None:
        """The next `times` calls of `at` fail (None: every call until `restore`)."""
        if at not in FAULT_POINTS:
            raise ValueError(f"fail(at={at!r}): use one of {', '.join(FAULT_POINTS)}")
        if times is not None and times < 1:
            raise ValueError(f"fail(times={times!r}): use a count of 1 or more, or None")
        with self._faults_lock:
            self._faults[at] = times

    def restore(self) -> None:
        """The lock server answers again."""
        with self._faults_lock:
            self._faults.clear()

    def _fault(self, at: str) -> None:
        with self._faults_lock:
            if at not in self._faults:
                return
            left = self._faults[at]
            if left is not None:
                if left <= 1:
                    del self._faults[at]
                else:
                    self._faults[at] = left - 1
        raise BackendUnavailable(f"lock server unavailable at {at} (simulated by jobfence.testing)")

    def _run_out(self, lease: Lease) -> None:
        """`lease`'s time passes: its grant expires here and its deadline in the worker."""
        self.release_grant(lease.key, lease.fence)
        lease.deadline = min(lease.deadline, self.clock.monotonic())

    def begin(self, key: str, ttl: float, **options: Any) -> BeginResult:
        self._fault("begin")
        return super().begin(key, ttl, **options)

    def commit(
        self, lease: Lease, *, state: str, result: str, fingerprint: str, result_ttl: float
    ) -> bool:
        try:
            self._fault("commit")
        except BackendUnavailable:
            with self._faults_lock:
                for_good = self._faults.get("commit", 0) is None
            if for_good:
                self._run_out(lease)
            raise
        return super().commit(
            lease, state=state, result=result, fingerprint=fingerprint, result_ttl=result_ttl
        )


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


class JobfenceTesting:
    """What the `jobfence` fixture gives a test: the lock server, the decisions, fault helpers
    and assertions. Build it with `in_memory()`."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.lock_server = LockServerForTests()
        self._settings = settings
        self._runtimes: dict[int, tuple[Any, runtimes.Runtime]] = {}
        self._decisions: list[Decision] = []
        self._triggers: list[Trigger] = []
        self._lock = threading.RLock()

    # -- the runtime every app gets -----------------------------------------------------
    def runtime_for(self, app: Any) -> runtimes.Runtime:
        """The test runtime of `app`: the app's own settings (or JOBFENCE_*), on this test's
        lock server."""
        with self._lock:
            found = self._runtimes.get(id(app))
            if found is not None:
                return found[1]
            own = runtimes.installed(app)
            base = self._settings or (own.settings if own is not None else load_settings())
            settings = base.model_copy(update={"lock_url": f"{backend_schemes('memory').plain}://"})
            runtime = runtimes.Runtime(settings, backend=self.lock_server)
            runtime.executor.observers.append(self._observe)
            self._runtimes[id(app)] = (app, runtime)
            return runtime

    def close(self) -> None:
        with self._lock:
            for _, runtime in self._runtimes.values():
                runtime.keeper.stop()
                if runtime._effects is not None:
                    runtime._effects.engine.dispose()
            self._runtimes.clear()
        self.lock_server.close()

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

    # -- faults ---------------------------------------------------------------------------
    def publish_duplicate(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The job published twice (two messages, two task ids), both delivered; returns
        their results (EagerResult)."""
        return [self._deliver(task, args, kwargs) for _ in range(2)]

    def redeliver(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """One message delivered twice (the same task id), as after a lost ack."""
        task_id = str(uuid4())
        return [self._deliver(task, args, kwargs, task_id) for _ in range(2)]

    def lose_lease_during(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The job runs; as its body starts its lease expires, and a copy takes the key (a
        newer fence) and runs to the end; then the first body goes on. Returns both results,
        the first delivery's last."""
        first = str(uuid4())
        results: list[Any] = []

        def copy_runs(d: Decision) -> bool:
            if d.task_id != first or d.event not in ("started", "plain_started"):
                return False
            if d.key:
                self.lock_server.force_release(d.key)
            results.append(self._deliver(task, args, kwargs))
            return True

        (last,) = self._armed(copy_runs, lambda: self._deliver(task, args, kwargs, first))
        return [*results, last]

    def stale_fence_during(
        self, task: Any, advance: Callable[[int], Any], /, *args: Any, **kwargs: Any
    ) -> Any:
        """The job runs; as its body starts, a newer holder takes the key and calls
        `advance(newer_fence)` (your guard's write, e.g. ``lambda f:
        guard.check_and_advance("payment:7", f)``); the body's guarded write then carries a
        stale fence. A plain task has no fence: `advance(1)`. Returns the result."""
        first = str(uuid4())

        def newer_holder(d: Decision) -> bool:
            if d.task_id != first or d.event not in ("started", "plain_started"):
                return False
            newer = 1
            if d.key:
                self.lock_server.force_release(d.key)
                lease = self.lock_server.try_acquire(d.key, 60.0)
                assert lease is not None, "the key was just freed"
                newer = lease.fence
                lease.release()
            advance(newer)
            return True

        return self._armed(newer_holder, lambda: self._deliver(task, args, kwargs, first))[0]

    def unavailable_at_begin(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The job published twice while the lock server does not answer; once it answers,
        each delivery that did not settle is delivered again. Returns the last results."""
        self.lock_server.fail("begin", times=None)
        try:
            ids = [str(uuid4()) for _ in range(2)]
            results = [self._deliver(task, args, kwargs, i) for i in ids]
        finally:
            self.lock_server.restore()
        return [
            self._deliver(task, args, kwargs, i) if _unsettled(r) else r
            for i, r in zip(ids, results, strict=True)
        ]

    def unavailable_at_commit(self, task: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The body runs, and the lock server answers none of the job's commits until its
        lease has run out: the commit's outcome is unknown, and the message is delivered
        again (the body runs again; only its effects' own DONE rows, or a write that is
        idempotent, keep it from taking effect twice). Returns both results."""
        task_id = str(uuid4())
        self.lock_server.fail("commit", times=None)
        try:
            first = self._deliver(task, args, kwargs, task_id)
        finally:
            self.lock_server.restore()
        return [first, self._deliver(task, args, kwargs, task_id)]

    @contextmanager
    def lock_server_down(self, at: FaultPoint | None = None) -> Iterator[None]:
        """Inside: the lock server answers no `at` ("begin", "commit"; None: neither)."""
        for point in FAULT_POINTS if at is None else (at,):
            self.lock_server.fail(point, times=None)  # type: ignore[arg-type]
        try:
            yield
        finally:
            self.lock_server.restore()

    def _armed(self, trigger: Trigger, deliver: Callable[[], Any]) -> list[Any]:
        with self._lock:
            self._triggers.append(trigger)
        try:
            return [deliver()]
        finally:
            with self._lock:
                if trigger in self._triggers:
                    self._triggers.remove(trigger)

    def _deliver(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 task_id: str | None = None) -> Any:  # fmt: skip
        with _as_committed_by_a_worker():
            return task.apply(args=args, kwargs=kwargs, task_id=task_id or str(uuid4()))


@contextmanager
def _as_committed_by_a_worker() -> Iterator[None]:
    """A delivery commits as a worker's would, even inside a test's own transaction.

    A worker runs each delivery in a transaction of its own, committed when the body ends.
    A Django test (``TestCase``, pytest-django's default ``django_db``) runs inside one
    atomic block, rolled back at its end: there the job's effects become a savepoint, its
    DONE record waits for an ``on_commit`` that never comes, and a duplicate delivery runs
    the body and is answered by the DONE row alone. Where every open block on a connection
    is the test case's own, the ``on_commit`` callbacks the delivery registered run when it
    returns (what ``TestCase.captureOnCommitCallbacks(execute=True)`` does), so the next
    copy is answered by the DONE record, as on a fleet. The lock server is the test's own,
    gone with the test's rollback; a block of the test's own (``transaction.atomic()``)
    keeps its callbacks until it commits."""
    db, conf = sys.modules.get("django.db"), sys.modules.get("django.conf")
    if db is None or conf is None or not conf.settings.configured:  # no Django project here
        yield
        return
    marks: list[tuple[Any, int]] = []
    for connection in db.connections.all(initialized_only=True):
        blocks = getattr(connection, "atomic_blocks", [])
        if (
            connection.in_atomic_block
            and blocks
            and all(getattr(block, "_from_testcase", False) for block in blocks)
        ):
            marks.append((connection, len(connection.run_on_commit)))
    yield
    for connection, mark in marks:
        if connection.in_atomic_block and len(connection.run_on_commit) > mark:
            callbacks = connection.run_on_commit[mark:]
            del connection.run_on_commit[mark:]
            for _, callback, robust in callbacks:
                if robust:
                    try:
                        callback()
                    except Exception:  # robust: Django logs it and goes on
                        _log.exception("on_commit callback %r failed", callback)
                else:
                    callback()


@contextmanager
def in_memory(settings: Settings | None = None) -> Iterator[JobfenceTesting]:
    """A fresh in-memory lock server for every app and `@singleton_task` while inside.

    `settings`: the settings every app's test runtime takes (default: the app's own, or
    JOBFENCE_*), always with the lock server in memory. Nests; restores what was before.
    """
    from celery.signals import task_postrun, task_prerun  # Celery: only once it is used

    jf = JobfenceTesting(settings)
    previous = runtimes.substitute(jf.runtime_for)
    task_prerun.connect(jf._on_prerun, weak=False)
    task_postrun.connect(jf._on_postrun, weak=False)
    try:
        yield jf
    finally:
        task_prerun.disconnect(jf._on_prerun)
        task_postrun.disconnect(jf._on_postrun)
        runtimes.substitute(previous)
        jf.close()


class JobfenceTestCase(unittest.TestCase):
    """A unittest (or Django) TestCase mixin: each test runs inside `in_memory()`, as
    `self.jobfence`. Put it first: ``class T(JobfenceTestCase, django.test.TestCase)``."""

    jobfence: JobfenceTesting

    def setUp(self) -> None:
        super().setUp()
        manager = in_memory()
        self.jobfence = manager.__enter__()
        self.addCleanup(manager.__exit__, None, None, None)


# -- helpers --------------------------------------------------------------------------------
def _task_name(task: Any) -> str:
    return task if isinstance(task, str) else str(task.name)


def _is_jobfence(task: Any) -> bool:
    return isinstance(task, SingletonTask)


def _unsettled(result: Any) -> bool:
    return isinstance(getattr(result, "result", None), JobNotSettled)


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
