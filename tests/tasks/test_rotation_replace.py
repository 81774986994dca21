"""A job lost under `on_duplicate_publish="replace"` + a key rotation (issue 29, the long run's
seed `two-secrets-each-superseded-after-lost-leases`).

The publish claim is made under the publisher's secret. Copy T, published under secret A
(claim A: "T", queued), ran under secret B: it marked only claim B started and lost its lease
before its commit. The next publish T2, under A, found claim A still queued and replaced it.
T2, delivered under B, met T's started mark there and was skipped as superseded; T's copies,
under A, met T2's claim and were skipped as superseded too: neither ran. Now a run marks the
claim under every secret's key, so claim A says T started, T2 is not a replacement, and T's
copy runs.
"""

from __future__ import annotations

import pytest

from jobfence.locks.backend import JobRecord
from jobfence.locks.drive import run_sync
from jobfence.tasks import Executor
from jobfence.tasks.executor import JobSpec
from jobfence.tasks.publish import publish_flow
from tests.tasks.conftest import spec_for, unique


class BodyRetried(Exception):
    """Stands for Celery's Retry (or a lease lost before the commit): released, no record."""


def _spec(key: str, other: str, task_id: str) -> JobSpec:
    return spec_for(key, task_id=task_id, supersede=True, publish_claim=True, queues=True,
                    fingerprint="fp", previous=((other, "fp"),))  # fmt: skip


def _unfinished(_ctx: object) -> None:
    raise BodyRetried


def test_a_replace_under_one_secret_of_a_run_under_the_other_never_loses_the_job(
    executor: Executor,
) -> None:
    a, b = unique("tests.job:secret-a"), unique("tests.job:secret-b")
    backend = executor.backend
    assert backend.claim_publish(a, "T", 60.0) is None  # T published under secret A
    with pytest.raises(BodyRetried):  # T runs under secret B, and does not finish
        executor.run(_spec(b, a, "T"), _unfinished, passthrough=(BodyRetried,))
    # T2, a publish of the same job under secret A with on_duplicate_publish="replace" (a
    # chain's head: a duplicate goes out unclaimed and meets the holder at the gate).
    flow = publish_flow(a, "T2", 60.0, policy="replace", workflow=True, name="tests.job")
    decision = run_sync(flow, backend, backend.clock)
    ran: list[str] = []
    outcomes = {}
    if decision.action != "result":
        t2 = executor.run(_spec(b, a, "T2"), lambda _ctx: ran.append("T2"))
        outcomes["T2"] = t2.status
    t = executor.run(_spec(a, b, "T"), lambda _ctx: ran.append("T"))  # T's copy, under A
    outcomes["T"] = t.status
    assert len(ran) == 1, f"the job ran {len(ran)} times: {outcomes}"
    assert decision.action == "unclaimed", "T had started: T2 is not a replacement of it"
    assert ran == ["T"] and outcomes["T2"] == "superseded"


def test_a_replaced_copy_meeting_its_replacement_leaves_no_claim_under_the_other_key(
    executor: Executor,
) -> None:
    """The long run's next seed (`rotation-replace-unique-for-rate-chain-lost`): T1 replaced
    T0 under secret A and holds the job's grant under B; T0, delivered under B, met it and
    asked whether the claim still named it, by a compare-and-set that made a claim for T0
    under B, where no publish had put one. T1, marking B's claim as it started, found T0's
    and was skipped as superseded; T0 then met T1's mark: neither ran. Now the look leaves
    no claim behind: T0 is a duplicate of T1, and T1 runs."""
    a, b = unique("tests.job:secret-a"), unique("tests.job:secret-b")
    backend = executor.backend
    assert backend.claim_publish(a, "T0", 60.0) is None  # T0 published under A ...
    assert backend.swap_publish(a, "T0", "T1", 60.0) is None  # ... replaced by T1
    held = executor.begin(_spec(b, a, "T1"))  # T1's grant under B, not started yet
    assert held is not None and not isinstance(held, JobRecord)
    ran: list[str] = []
    t0 = executor.run(_spec(b, a, "T0"), lambda _ctx: ran.append("T0"))
    assert backend.swap_publish(b, "?probe", "?probe", 60.0) is None, "a claim was left under B"
    assert backend.swap_publish(b, "?probe", None, 60.0) is None  # (the look's own, taken back)
    assert held.release()
    t1 = executor.run(_spec(b, a, "T1"), lambda _ctx: ran.append("T1"))
    assert ran == ["T1"], (t0.status, t1.status)
