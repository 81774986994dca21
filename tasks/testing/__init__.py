"""Testing your own tasks: a fresh in-memory lock server per test, fault helpers, assertions.

`in_memory()` (a context manager; the pytest fixture `jobfence` and `JobfenceTestCase` use
it) answers every app's runtime with one built on a fresh `memory://` lock server for as
long as it lasts: apps set up with `jobfence.setup`, apps built by a test (Celery's
`celery_app` fixture) and `@singleton_task` alone. Nothing is written to a real lock server,
and no app's own runtime is touched. Every decision the executor takes is recorded
(`Executor.observers`), and plain Celery tasks are seen through `task_prerun`/`task_postrun`,
so one test can show a naive task failing where a jobfence task passes.

The package: `fixture.py` (`in_memory`, `JobfenceTesting`, `JobfenceTestCase`),
`record.py` (the decisions, counted and asserted on), `faults.py` (the fault helpers) and
`lock_server.py` (`memory://` with a fault switch).
"""

from jobfence.tasks.testing.faults import FaultHelpers
from jobfence.tasks.testing.fixture import JobfenceTestCase, JobfenceTesting, in_memory
from jobfence.tasks.testing.lock_server import FAULT_POINTS, FaultPoint, LockServerForTests
from jobfence.tasks.testing.record import (
    ABSORBED,
    NO_EFFECT,
    RAN_TO_END,
    Decision,
    DecisionRecord,
    Trigger,
)

__all__ = [
    "ABSORBED",
    "FAULT_POINTS",
    "NO_EFFECT",
    "RAN_TO_END",
    "Decision",
    "DecisionRecord",
    "FaultHelpers",
    "FaultPoint",
    "JobfenceTestCase",
    "JobfenceTesting",
    "LockServerForTests",
    "Trigger",
    "in_memory",
]
