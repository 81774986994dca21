"""Row f: a worker SIGKILLed while it holds prefetched messages (prefetch multiplier 4 on both
sides). Celery's default early ack loses the bodies that were running; jobfence (acks_late,
reject_on_worker_lost, the lease and the DONE record) does every job once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.scenarios_cdefh import row_f

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_naive_early_ack_loses_the_running_jobs_of_a_killed_worker(tmp_path: Path) -> None:
    outcome = row_f("naive", tmp_path, False)
    assert outcome.lost > 0, outcome


def test_jobfence_does_every_prefetched_job_once_after_a_sigkill(tmp_path: Path) -> None:
    outcome = row_f("jobfence", tmp_path, False)
    assert not outcome.failed, outcome
    assert (outcome.double, outcome.lost) == (0, 0), outcome
