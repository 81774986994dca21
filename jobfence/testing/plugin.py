"""The pytest plugin (entry point `pytest11`): the fixture `jobfence`, one fresh in-memory lock
server per test for every app and `@singleton_task`, with fault helpers and assertions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from jobfence.tasks.testing import JobfenceTesting, in_memory


@pytest.fixture
def jobfence() -> Iterator[JobfenceTesting]:
    """A fresh in-memory lock server for this test (README "Testing your tasks")."""
    with in_memory() as jf:
        yield jf
