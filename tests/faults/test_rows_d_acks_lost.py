"""Row d: the broker restarts with its data kept (AOF) and the workers die after their bodies
committed, before the ack. A plain acks_late task charges again on redelivery; jobfence
answers the redelivered messages from the DONE record."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.scenarios_cdefh import row_d

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_naive_acks_late_task_charges_again_when_its_ack_is_lost(tmp_path: Path) -> None:
    outcome = row_d("naive", tmp_path, False)
    assert outcome.double > 0, outcome
    assert outcome.lost == 0, outcome  # the broker kept the messages: none lost, only doubled


def test_jobfence_charges_once_when_the_broker_restarts_and_acks_are_lost(
    tmp_path: Path,
) -> None:
    outcome = row_d("jobfence", tmp_path, False)
    assert not outcome.failed, outcome
    assert (outcome.double, outcome.lost) == (0, 0), outcome
