"""Row h: the lock server is down when the workers start, and again mid-run. A task with a
plain Redis lock fails its jobs for good; jobfence's workers start with a warning, the jobs
wait (redelivered with backoff) and complete once when the server returns."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.scenarios_cdefh import row_h

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_naive_locked_task_loses_jobs_while_the_lock_server_is_down(tmp_path: Path) -> None:
    outcome = row_h("naive", tmp_path, False)
    assert outcome.lost > 0, outcome


def test_jobfence_jobs_wait_for_the_lock_server_and_complete_once(tmp_path: Path) -> None:
    outcome = row_h("jobfence", tmp_path, False)
    assert not outcome.failed, outcome
    assert (outcome.double, outcome.lost) == (0, 0), outcome
