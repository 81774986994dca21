"""Row e: a message that kills its worker every time loops for ever in plain Celery; jobfence
caps its crashed deliveries, records FAILED and logs one dead-letter line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.scenarios_cdefh import POISON_CAP, row_e

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def test_naive_poison_message_is_delivered_again_and_again(tmp_path: Path) -> None:
    outcome = row_e("naive", tmp_path, False)
    assert outcome.failed, outcome  # the control bites: LOOP_PROOF deliveries and counting


def test_jobfence_caps_a_poison_message_then_records_failed_and_dead_letters(
    tmp_path: Path,
) -> None:
    outcome = row_e("jobfence", tmp_path, False)
    assert not outcome.failed, outcome
    assert f"(cap {POISON_CAP})" in outcome.detail
