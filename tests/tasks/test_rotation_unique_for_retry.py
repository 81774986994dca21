"""A job lost under `unique_for` + a key rotation + a body that retries (issue 29, the long run).

The publish claim and its started mark were kept per key, and during a rotation each secret has
its own key. Run T marks claim A and retries; another publish C of the job, under secret B,
finds claim B empty (the previous-secret look reads lock A and record A, not claim A), marks it
and retries too; each retry copy then landed under the other secret, met the other run's mark
and was skipped as "ran within unique_for": neither finished. Now a run marks (and reads) the
claim under every secret's key, so C is throttled by T's mark and T's retry copy runs.
"""

from __future__ import annotations

import pytest

from jobfence.tasks import Executor
from jobfence.tasks.executor import JobSpec
from tests.tasks.conftest import spec_for, unique


class BodyRetried(Exception):
    """Stands for Celery's Retry: a passthrough that releases without a record."""


def _spec(key: str, other: str, task_id: str) -> JobSpec:
    return spec_for(key, task_id=task_id, unique_for=1.0, queues=True, fingerprint="fp",
                    previous=((other, "fp"),))  # fmt: skip


def _retries(_ctx: object) -> None:
    raise BodyRetried


def test_two_runs_under_two_secrets_that_retry_are_not_both_throttled(executor: Executor) -> None:
    a, b = unique("tests.job:secret-a"), unique("tests.job:secret-b")
    ran: list[str] = []
    with pytest.raises(BodyRetried):  # T, under secret A: marks claim A, retries
        executor.run(_spec(a, b, "T"), _retries, passthrough=(BodyRetried,))
    try:  # C, under secret B: throttled by T's mark (the fix), or runs and retries (today)
        out = executor.run(_spec(b, a, "C"), _retries, passthrough=(BodyRetried,))
        assert out.status == "duplicate"
        c_retried = False
    except BodyRetried:
        c_retried = True
    # The retry copies, each under the other secret.
    t_copy = executor.run(_spec(b, a, "T"), lambda _ctx: ran.append("T"))
    outcomes = [t_copy.status]
    if c_retried:
        c_copy = executor.run(_spec(a, b, "C"), lambda _ctx: ran.append("C"))
        outcomes.append(c_copy.status)
    assert ran, f"neither run finished: {outcomes}"  # the job lost
