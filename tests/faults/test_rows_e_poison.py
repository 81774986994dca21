"""Row e: a message that kills its worker every time loops for ever in plain Celery; jobfence
caps its crashed deliveries, records FAILED and logs one dead-letter line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from jobfence.locks import Backoff, LeaseKeeper, MemoryBackend
from jobfence.tasks import Executor, PoisonMessage
from tests.faults.scenarios_cdefh import POISON_CAP, row_e
from tests.tasks.conftest import spec_for


@pytest.mark.fault
@pytest.mark.integration
@pytest.mark.slow
def test_naive_poison_message_is_delivered_again_and_again(tmp_path: Path) -> None:
    outcome = row_e("naive", tmp_path, False)
    assert outcome.failed, outcome  # the control bites: LOOP_PROOF deliveries and counting


@pytest.mark.fault
@pytest.mark.integration
@pytest.mark.slow
def test_jobfence_caps_a_poison_message_then_records_failed_and_dead_letters(
    tmp_path: Path,
) -> None:
    outcome = row_e("jobfence", tmp_path, False)
    assert not outcome.failed, outcome
    assert f"(cap {POISON_CAP})" in outcome.detail
    assert "1 dead-letter line(s)" in outcome.detail


# -- the cap itself, on one backend in process (the counting and the verdict) ------------------


def _died_before(backend: MemoryBackend, key: str, times: int) -> None:
    for _ in range(times):  # what the grants of `times` crashed deliveries left behind
        backend.count_delivery(key, 3600.0)


def test_a_crash_suspect_grant_past_the_cap_records_failed_and_logs_one_dead_letter_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend()
    executor = Executor(backend, LeaseKeeper(), backoff=Backoff(0.005, 0.05))
    key = "poison-key"
    _died_before(backend, key, POISON_CAP)
    ran: list[str] = []
    spec = spec_for(key, suspect=True, max_crashed=POISON_CAP)
    with caplog.at_level(logging.ERROR), pytest.raises(PoisonMessage):
        executor.run(spec, lambda ctx: ran.append("body"))
    assert ran == []  # the body did not run a fifth time
    record = backend.job_record(key)
    assert record is not None and record.state == "FAILED"
    assert json.loads(record.result)["error"] == "PoisonMessage"
    lines = [r.getMessage() for r in caplog.records if "dead-letter" in r.getMessage()]
    assert len(lines) == 1 and key in lines[0] and spec.name in lines[0]
    # Another crash-suspect copy of the same message is refused too, without a second line.
    with caplog.at_level(logging.ERROR), pytest.raises(PoisonMessage):
        executor.run(spec, lambda ctx: ran.append("body"))
    assert ran == []
    assert len([r for r in caplog.records if "dead-letter" in r.getMessage()]) == 1


def test_grants_up_to_the_cap_and_fresh_deliveries_run_the_body() -> None:
    backend = MemoryBackend()
    executor = Executor(backend, LeaseKeeper(), backoff=Backoff(0.005, 0.05))
    key = "flaky-key"
    _died_before(backend, key, POISON_CAP - 1)
    suspect = spec_for(key, suspect=True, max_crashed=POISON_CAP)
    assert executor.run(suspect, lambda ctx: "ok").status == "ran"  # count == cap: runs
    other = "fresh-key"
    _died_before(backend, other, POISON_CAP + 5)
    fresh = spec_for(other, suspect=False, max_crashed=POISON_CAP)
    assert executor.run(fresh, lambda ctx: "ok").value == "ok"  # not crash-suspect: not counted


def test_runs_that_share_a_key_under_per_run_lifetimes_each_get_their_own_crash_count() -> None:
    """Issue 18 #13: with a cap of 2, two runs of one key that each crashed once and then
    succeeded must not make the third run's first crash final."""
    backend = MemoryBackend()
    executor = Executor(backend, LeaseKeeper(), backoff=Backoff(0.005, 0.05))
    key = "nightly-key"
    for run in ("run-1", "run-2", "run-3"):
        # Each run's delivery after its one crash: counted, granted, its body runs to DONE.
        spec = spec_for(key, task_id=run, lock_until="start", suspect=True, max_crashed=2)
        assert executor.run(spec, lambda ctx: "ok").status == "ran", run
    record = backend.job_record(key)
    assert record is not None and record.state == "DONE"


def test_every_copy_of_one_run_shares_its_crash_count() -> None:
    backend = MemoryBackend()
    executor = Executor(backend, LeaseKeeper(), backoff=Backoff(0.005, 0.05))
    spec = spec_for("loop-key", task_id="run-1", lock_until="start", suspect=True, max_crashed=2)
    ran: list[str] = []

    def dies(ctx: object) -> None:
        ran.append("body")
        raise SystemExit  # a FAILED record does not stop a new grant of the same run

    for _ in range(2):  # two grants after crashes: within the cap, the body runs again
        with pytest.raises(SystemExit):
            executor.run(spec, dies)
    with pytest.raises(PoisonMessage):
        executor.run(spec, dies)  # the same run's third crash-suspect grant: past the cap
    assert ran == ["body", "body"]
