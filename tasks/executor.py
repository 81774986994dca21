"""The lock-gated executor: the sync shell that runs the job lifecycle (tasks/lifecycle.py).

The flows decide; this shell runs them with `run_sync` and does what is no store round trip:
the keeper, the body between `set_current` and `reset_current`, the observers, the
callers' commit hooks, and the spans where opentelemetry-api is installed (tasks/tracing.py).
The public names the task layer and users import live here too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from jobfence.locks.acquire import Backoff
from jobfence.locks.backend import LockBackend
from jobfence.locks.decisions import Decision
from jobfence.locks.drive import run_sync
from jobfence.locks.errors import LeaseLost
from jobfence.locks.flows import Flow
from jobfence.locks.keeper import LeaseKeeper
from jobfence.locks.lease import Lease
from jobfence.locks.ops import Commit, StoreOp
from jobfence.tasks.context import JobContext, reset_current, set_current
from jobfence.tasks.decisions import DecisionRecorder
from jobfence.tasks.lifecycle import (
    CONFLICT_POLICIES,
    DROPPED,
    DUPLICATE,
    LEASE_LOST_POLICIES,
    LOCK_UNTIL,
    RATE_HORIZON,
    RATE_LIMITED_POLICIES,
    RATE_SKIPPED,
    STARTED,
    SUPERSEDED,
    AfterOuterCommit,
    ConflictPolicy,
    Drop,
    Job,
    JobFlow,
    JobSpec,
    Keep,
    LeaseLostPolicy,
    LockUntil,
    Note,
    Observer,
    Outcome,
    RateLimitedPolicy,
    RateSpec,
    Redelivery,
    RedeliveryLimitReached,
    RunBody,
    ShellOp,
    Status,
)
from jobfence.tasks.metrics import Metrics
from jobfence.tasks.tracing import JobTrace, JobTracer, job_tracer

__all__ = [
    "CONFLICT_POLICIES",
    "DROPPED",
    "DUPLICATE",
    "LEASE_LOST_POLICIES",
    "LOCK_UNTIL",
    "RATE_HORIZON",
    "RATE_LIMITED_POLICIES",
    "RATE_SKIPPED",
    "STARTED",
    "SUPERSEDED",
    "ConflictPolicy",
    "Executor",
    "JobSpec",
    "LeaseLostPolicy",
    "LockUntil",
    "Observer",
    "Outcome",
    "RateLimitedPolicy",
    "RateSpec",
    "Redelivery",
    "RedeliveryLimitReached",
    "Status",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Executor:
    """Runs job bodies under a lease. No Celery here: the task layer translates outcomes.

    Round trips on Redis for a job that runs: one `begin` (DONE check and grant),
    one `commit` (DONE record and release), plus the keeper's batched extensions.
    """

    def __init__(
        self,
        backend: LockBackend,
        keeper: LeaseKeeper,
        *,
        backoff: Backoff,
        metrics: Metrics | None = None,
        redelivery: Redelivery | None = None,
        tracing: bool = True,
    ) -> None:
        self.observers: list[Observer] = []  # told of every event: started, done, replayed...
        # None without opentelemetry-api (or tracing=False): then nothing traces, at no cost.
        self.tracer: JobTracer | None = job_tracer() if tracing else None
        # Given each delivery's decisions once, as it ends (the runtime attaches one).
        self.recorder: DecisionRecorder | None = None
        self.backend = backend
        self.keeper = keeper
        self.backoff = backoff
        self.redelivery = redelivery or Redelivery()
        self.metrics = metrics or Metrics()

    def run(
        self,
        spec: JobSpec,
        body: Callable[[JobContext], Any],
        *,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> Outcome:
        """Run `body` once for `spec.key`. Exceptions in `passthrough` release without a record."""
        job = self._job(spec)
        trace = None if self.tracer is None else self.tracer.start(spec)
        if trace is None:
            return self._drive(job, job.run(passthrough), body)
        with trace:
            return trace.outcome(self._drive(job, job.run(passthrough), body, trace))

    def begin(self, spec: JobSpec) -> Lease | Outcome:
        """Acquire the job's lease, or say why not (replay, duplicate, defer, retry, redeliver)."""
        job = self._job(spec)
        return self._drive(job, job.begin(), None)

    def release(self, lease: Lease) -> None:
        """Release without a record (a retry is on its way, or the body was interrupted)."""
        self.keeper.drop(lease)
        if not lease.released:
            lease.release()

    def _job(self, spec: JobSpec) -> Job:
        return Job(spec, backoff=self.backoff, redelivery=self.redelivery, metrics=self.metrics,
                   noting=bool(self.observers) or self.recorder is not None)  # fmt: skip

    def _drive(
        self,
        job: Job,
        flow: JobFlow[T],
        body: Callable[[JobContext], Any] | None,
        trace: JobTrace | None = None,
    ) -> T:
        # run_sync hands the shell's ops to `_Shell.execute` like any store op; the cast
        # widens Flow's op type to the job's (the driver only dispatches on Now and Sleep).
        shell = _Shell(self, job, body) if trace is None else _TracedShell(self, job, body, trace)
        try:
            return run_sync(cast("Flow[T]", flow), shell, self.backend.clock)
        finally:
            decisions = shell.decisions
            if decisions:  # handed over once per delivery, however many it made
                assert self.recorder is not None
                if len(decisions) == 2 and decisions[0].event == "started" and \
                        decisions[1].event in ("done", "failed"):  # fmt: skip
                    decisions = decisions[1:]  # a plain run: its end says it was granted
                self.recorder.record(decisions)


class _Shell:
    """One delivery's store for `run_sync`: the shell's ops here, round trips to the backend."""

    __slots__ = ("body", "decisions", "executor", "job")

    def __init__(
        self, executor: Executor, job: Job, body: Callable[[JobContext], Any] | None
    ) -> None:
        self.executor = executor
        self.job = job
        self.body = body
        self.decisions: list[Decision] | None = [] if executor.recorder is not None else None

    def execute(self, op: StoreOp | ShellOp) -> Any:
        kind = type(op)
        if kind is Note:
            if self.executor.observers:  # none unless a journal is attached
                self.note(op)  # type: ignore[arg-type]
            if self.decisions is not None:
                self.decide(op)  # type: ignore[arg-type]
        elif kind is RunBody:
            return self.run_body(op.ctx)  # type: ignore[union-attr]
        elif kind is Keep:
            self.keep(op)  # type: ignore[arg-type]
        elif kind is Drop:
            self.executor.keeper.drop(op.lease)  # type: ignore[union-attr]
        elif kind is AfterOuterCommit:
            self.after_outer_commit(op)  # type: ignore[arg-type]
        else:
            return self.executor.backend.execute(op)  # type: ignore[arg-type]
        return None

    def note(self, op: Note) -> None:
        for observe in self.executor.observers:
            try:
                observe(op.event, self.job.spec, op.fence)
            except Exception:  # an observer must never change the job's fate
                log.exception("executor observer failed on %s", op.event)

    def decide(self, op: Note) -> None:
        assert self.decisions is not None
        spec = self.job.spec
        self.decisions.append(Decision(time.time(), op.event, spec.key, spec.name, spec.task_id,
                                       op.fence, op.holder, op.newer, op.reason))  # fmt: skip

    def run_body(self, ctx: JobContext) -> Any:
        assert self.body is not None, "RunBody from a flow that runs no body"
        token = set_current(ctx)
        try:
            return self.body(ctx)
        finally:
            reset_current(token)

    def keep(self, op: Keep) -> None:
        self.executor.keeper.keep(op.lease)
        tie = op.tie
        if tie is None:
            return

        def tie_lost(_lease: Lease, cause: BaseException) -> None:
            tie.mark_lost(LeaseLost("concurrency slot lost", key=tie.key, fence=tie.fence,
                                    cause=cause))  # fmt: skip

        op.lease.on_lost(tie_lost)

    def after_outer_commit(self, op: AfterOuterCommit) -> None:
        """Store the DONE record once every caller's transaction the effect joined commits."""
        waiting = [len(op.ctx.outer)]
        executor, job = self.executor, self.job

        def committed() -> None:
            waiting[0] -= 1
            if not waiting[0]:
                executor._drive(job, job.record_done(op.result), None)

        for outer in op.ctx.outer:
            outer.then(committed)


class _TracedShell(_Shell):
    """The shell with a delivery's spans (tasks/tracing.py): the body and each commit inside
    their own, every note an event; the untraced shell stays as it is."""

    __slots__ = ("trace",)

    def __init__(
        self,
        executor: Executor,
        job: Job,
        body: Callable[[JobContext], Any] | None,
        trace: JobTrace,
    ) -> None:
        super().__init__(executor, job, body)
        self.trace = trace

    def execute(self, op: StoreOp | ShellOp) -> Any:
        kind = type(op)
        if kind is RunBody:
            return self.trace.body(op.ctx, self.run_body)  # type: ignore[union-attr]
        if kind is Commit:
            return self.trace.commit(op, self.executor.backend.execute)  # type: ignore[arg-type]
        if kind is Note:
            self.trace.note(op)  # type: ignore[arg-type]
        return super().execute(op)
