"""The job lifecycle's names where they were always imported from; the flow lives in tasks/flow/."""

# A flow yields ops (locks/ops.py for the store's round trips; `Keep`, `Drop`, `RunBody` and
# `AfterOuterCommit`, tasks/flow/ops.py, for what the shell does; an `Event`, tasks/events.py,
# for its observers) and returns an `Outcome`, or raises what the caller must see. It never
# logs or counts (the shell's middleware do), never touches a socket, a clock, a thread or
# the body: `Executor` (tasks/executor.py) runs it with `run_sync`, and a test runs it by hand
# with scripted replies (tests/tasks/test_lifecycle.py), every branch of the safety argument.
# `Job.run` (tasks/flow/job.py) reads the phases in order: gate, claim, admission, body, settle.

from jobfence.tasks.flow.admission import (
    RATE_ARRIVAL_SLACK,
    RATE_HORIZON,
    RATE_INLINE,
    RATE_START_SLACK,
    SLOT_REQUEUE_DELAY,
    START_SUFFIX,
)
from jobfence.tasks.flow.ending import STARTED, fingerprints_met
from jobfence.tasks.flow.job import Job, job_flow
from jobfence.tasks.flow.ops import AfterOuterCommit, Drop, JobFlow, JobOp, Keep, RunBody, ShellOp
from jobfence.tasks.flow.rotation import ROTATION_GRACE
from jobfence.tasks.flow.settle import COMMIT_ATTEMPTS, LOST_BEFORE_COMMIT, NOT_STORED
from jobfence.tasks.flow.spec import (
    DROPPED,
    DUPLICATE,
    RATE_SKIPPED,
    SUPERSEDED,
    JobSpec,
    Outcome,
    RateSpec,
    Redelivery,
    RedeliveryLimitReached,
    Status,
)
from jobfence.tasks.options import LockUntil

__all__ = [
    "COMMIT_ATTEMPTS",
    "DROPPED",
    "DUPLICATE",
    "LOST_BEFORE_COMMIT",
    "NOT_STORED",
    "RATE_ARRIVAL_SLACK",
    "RATE_HORIZON",
    "RATE_INLINE",
    "RATE_SKIPPED",
    "RATE_START_SLACK",
    "ROTATION_GRACE",
    "SLOT_REQUEUE_DELAY",
    "STARTED",
    "START_SUFFIX",
    "SUPERSEDED",
    "AfterOuterCommit",
    "Drop",
    "Job",
    "JobFlow",
    "JobOp",
    "JobSpec",
    "Keep",
    "LockUntil",
    "Outcome",
    "RateSpec",
    "Redelivery",
    "RedeliveryLimitReached",
    "RunBody",
    "ShellOp",
    "Status",
    "fingerprints_met",
    "job_flow",
]
