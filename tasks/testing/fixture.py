"""The `jobfence` fixture: `in_memory()`, the `JobfenceTesting` it gives, `JobfenceTestCase`."""

from __future__ import annotations

import unittest
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jobfence.config.schemes import backend_schemes
from jobfence.config.settings import Settings, load_settings
from jobfence.tasks import runtime as runtimes
from jobfence.tasks.testing.faults import FaultHelpers
from jobfence.tasks.testing.lock_server import LockServerForTests


class JobfenceTesting(FaultHelpers):
    """What the `jobfence` fixture gives a test: the lock server, the decisions, fault helpers
    and assertions (record.py, faults.py). Build it with `in_memory()`."""

    def __init__(self, settings: Settings | None = None) -> None:
        super().__init__()
        self.lock_server = LockServerForTests()
        self._settings = settings
        self._runtimes: dict[int, tuple[Any, runtimes.Runtime]] = {}

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
