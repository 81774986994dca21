"""Testing your own tasks (README "Testing your tasks"): `in_memory()`, `JobfenceTestCase`,
and the pytest fixture `jobfence` (jobfence.testing.plugin, registered through `pytest11`)."""

from jobfence.tasks.testing import (
    ABSORBED,
    Decision,
    JobfenceTestCase,
    JobfenceTesting,
    LockServerForTests,
    in_memory,
)

__all__ = [
    "ABSORBED",
    "Decision",
    "JobfenceTestCase",
    "JobfenceTesting",
    "LockServerForTests",
    "in_memory",
]
