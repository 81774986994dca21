"""Row c: the lock server restarts with all its data lost in the middle of a payment storm on
real workers. A plain Redis "charged" marker forgets and charges again; jobfence charges every
payment exactly once and loses none (fences keep rising, the SQL DONE row answers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.scenarios_cdefh import row_c

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_naive_marker_lock_charges_again_after_the_lock_server_lost_its_data(
    tmp_path: Path,
) -> None:
    outcome = row_c("naive", tmp_path, False)
    assert outcome.double > 0, outcome


def test_jobfence_charges_every_payment_once_across_a_lock_server_data_loss(
    tmp_path: Path,
) -> None:
    outcome = row_c("jobfence", tmp_path, False)
    assert (outcome.double, outcome.lost) == (0, 0), outcome
    assert not outcome.failed, outcome  # and the balance matches the ledger
