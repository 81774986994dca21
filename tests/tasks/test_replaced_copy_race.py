"""A replacement meeting the copy it replaced at the gate (issue 29, found by the long run).

`dedupe_on_publish=True, on_duplicate_publish="replace"`: a publish P2 replaces a queued copy
P1 (the key's claim moves from P1 to P2). Delivered at the same moment, P1 may take the lease
first, find the claim is P2's, and give way (`JobSuperseded`); P2, meeting P1's lease, took it
for a running copy and was skipped (`on_conflict="skip"`) or refused ("raise"): neither ran,
the job was lost. The long redis run's seed: publish and duplicate, each with countdown 0.3.
"""

from __future__ import annotations

import pytest

from jobfence.locks import Lease
from jobfence.tasks import Executor
from jobfence.tasks.errors import DuplicateJob
from jobfence.tasks.executor import JobSpec
from tests.tasks.conftest import spec_for, unique


def _replaced(executor: Executor, key: str) -> None:
    """P1 published and claimed, then replaced by P2; P1's delivery holds the lease."""
    backend = executor.backend
    assert backend.claim_publish(key, "P1", 60.0) is None
    assert backend.swap_publish(key, "P1", "P2", 60.0) is None  # the replacing publish
    assert isinstance(executor.begin(_spec(key, "P1", "skip")), Lease)


def _spec(key: str, task_id: str, on_conflict: str, *, replace: bool = True) -> JobSpec:
    return spec_for(key, task_id=task_id, on_conflict=on_conflict, queues=True,
                    publish_claim=True, supersede=replace)  # fmt: skip


@pytest.mark.parametrize("on_conflict", ["skip", "raise"])
def test_the_replacement_comes_back_while_the_replaced_copy_holds_the_lease(
    executor: Executor, on_conflict: str
) -> None:
    key = unique("tests.job:replaced")
    _replaced(executor, key)
    ran: list[str] = []
    out = executor.run(_spec(key, "P2", on_conflict), lambda _ctx: ran.append("P2"))
    assert out.status == "requeue" and 0 < out.countdown <= 0.5, out  # not skipped, not refused
    assert ran == []


def test_control_without_replace_a_live_holder_is_a_duplicate(executor: Executor) -> None:
    """The same meeting with no replace policy: the holder is a running copy, skipped and
    refused as ever (the rule above is for a replacement only)."""
    key = unique("tests.job:plain")
    assert isinstance(executor.begin(_spec(key, "P1", "skip", replace=False)), Lease)
    out = executor.run(_spec(key, "P2", "skip", replace=False), lambda _ctx: None)
    assert out.status == "duplicate"
    with pytest.raises(DuplicateJob):
        executor.run(_spec(key, "P3", "raise", replace=False), lambda _ctx: None)
