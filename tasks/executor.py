"""The lock-gated executor: the sync shell that runs the job lifecycle (tasks/flow/).

The flows decide; this shell runs them with `run_sync` and does what is no store round trip:
the keeper, the body between `set_current` and `reset_current`, the callers' commit hooks,
and the middleware (tasks/middleware.py: each event a flow yields, each delivery's end, and
around the delivery, its body and its commits: log lines, metrics, the decision log, spans).
The public names the task layer and users import live here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar, cast

from jobfence.locks.acquire import Backoff
from jobfence.locks.backend import LockBackend
from jobfence.locks.drive import run_sync
from jobfence.locks.errors import LeaseLost
from jobfence.locks.flows import Flow
from jobfence.locks.keeper import LeaseKeeper
from jobfence.locks.lease import Lease
from jobfence.locks.ops import Commit, StoreOp
from jobfence.tasks.context import JobContext, reset_current, set_current
from jobfence.tasks.decisions import DecisionRecorder
from jobfence.tasks.events import TABLE, Event
from jobfence.tasks.flow.verdict import Verdict
from jobfence.tasks.lifecycle import (
    DROPPED,
    DUPLICATE,
    RATE_HORIZON,
    RATE_SKIPPED,
    STARTED,
    SUPERSEDED,
    AfterOuterCommit,
    Drop,
    Job,
    JobFlow,
    JobSpec,
    Keep,
    Outcome,
    RateSpec,
    Redelivery,
    RedeliveryLimitReached,
    RunBody,
    ShellOp,
    Status,
)
from jobfence.tasks.metrics import Metrics
from jobfence.tasks.middleware import (
    Decisions,
    Handler,
    Middleware,
    Observer,
    Observers,
    Plan,
    Tracing,
    overrides,
    standard,
)
from jobfence.tasks.options import (
    CONFLICT_POLICIES,
    LEASE_LOST_POLICIES,
    LOCK_UNTIL,
    RATE_LIMITED_POLICIES,
    ConflictPolicy,
    LeaseLostPolicy,
    LockUntil,
    RateLimitedPolicy,
)
from jobfence.tasks.tracing import JobTracer, job_tracer

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
M = TypeVar("M", bound=Middleware)


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
        middleware: Sequence[Middleware] | None = None,
    ) -> None:
        self.backend = backend
        self.keeper = keeper
        self.backoff = backoff
        self.redelivery = redelivery or Redelivery()
        self.metrics = metrics or Metrics()
        # Told of every event and every delivery's end; by default log lines, metrics and,
        # with opentelemetry-api installed (and tracing=True), spans.
        self.middleware: tuple[Middleware, ...] = ()
        if middleware is None:
            middleware = standard(self.metrics, tracer=job_tracer() if tracing else None)
        self.use(*middleware)

    def use(self, *middleware: Middleware) -> None:
        """Add middleware after those registered (a journal attached at start-up)."""
        self.middleware = (*self.middleware, *middleware)
        self._runs = tuple(m for m in self.middleware if overrides(m, "around_run"))
        self._routine = any(m.routine for m in self.middleware)
        self._plans: dict[frozenset[Middleware], Plan] = {}
        self._plan = self.plan_without(frozenset())

    def plan_without(self, left: frozenset[Middleware]) -> Plan:
        """Who the shell calls at each hook of a delivery that the middleware in `left` left
        (`Delivery.leave`), worked out once per such set."""
        plan = self._plans.get(left)
        if plan is None:
            plan = self._plans[left] = Plan.of([m for m in self.middleware if m not in left],
                                               left)  # fmt: skip
        return plan

    def find(self, kind: type[M]) -> M | None:
        """The registered middleware of type `kind`, if any."""
        return next((m for m in self.middleware if isinstance(m, kind)), None)

    @property
    def tracer(self) -> JobTracer | None:
        """The spans' tracer; None without opentelemetry-api (or tracing=False)."""
        tracing = self.find(Tracing)
        return tracing.tracer if tracing is not None else None

    @property
    def observers(self) -> list[Observer]:
        """Plain callables told of every decision (their middleware registered on first use)."""
        found = self.find(Observers)
        if found is None:
            found = Observers()
            self.use(found)
        return found.observers

    @property
    def recorder(self) -> DecisionRecorder | None:
        """The decision log's recorder, where its middleware is registered (to flush it)."""
        decisions = self.find(Decisions)
        return decisions.recorder if decisions is not None else None

    def run(
        self,
        spec: JobSpec,
        body: Callable[[JobContext], Any],
        *,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> Outcome:
        """Run `body` once for `spec.key`. Exceptions in `passthrough` release without a record."""
        job = self._job(spec)
        shell = _Shell(self, job, body)
        run = partial(self._drive_in, shell, job.ended(passthrough))
        for m in reversed(self._runs):  # the first registered outermost
            run = partial(m.around_run, shell, run)
        return run()

    def deliver(
        self,
        spec: JobSpec,
        body: Callable[[JobContext], Any],
        *,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> Verdict:
        """Run `body` once for `spec.key`, to the delivery's verdict: what the shell does."""
        job = self._job(spec)
        shell = _Shell(self, job, body)
        run = partial(self._drive_in, shell, job.deliver(passthrough))
        for m in reversed(self._runs):  # the first registered outermost
            run = partial(m.around_run, shell, run)
        return run()

    def begin(self, spec: JobSpec) -> Lease | Outcome:
        """Acquire the job's lease, or say why not (replay, duplicate, defer, retry, redeliver)."""
        job = self._job(spec)
        return self._drive(job, job.begin(), None)

    def close(self) -> None:
        """Close every middleware (what each holds pending is written out)."""
        for m in self.middleware:
            try:
                m.close()
            except Exception:
                log.exception("executor middleware %s failed to close", type(m).__name__)

    def _job(self, spec: JobSpec) -> Job:
        return Job(spec, backoff=self.backoff, redelivery=self.redelivery, noting=self._routine)

    def _drive(self, job: Job, flow: JobFlow[T], body: Callable[[JobContext], Any] | None) -> T:
        return self._drive_in(_Shell(self, job, body), flow)

    def _drive_in(self, shell: _Shell, flow: JobFlow[T]) -> T:
        # run_sync hands the shell's ops to `_Shell.execute` like any store op; the ignore
        # widens Flow's op type to the job's (the driver only dispatches on Now and Sleep),
        # as a cast would, without a call per delivery.
        try:
            return run_sync(flow, shell, self.backend.clock)  # type: ignore[arg-type]
        finally:
            for m in shell.plan.ending:
                try:
                    m.after_delivery(shell)
                except Exception:  # an observer must never change the job's fate
                    log.exception("executor middleware %s failed", type(m).__name__)


class _Shell:
    """One delivery's store for `run_sync`: the shell's ops here, round trips to the backend."""

    __slots__ = ("body", "executor", "job", "plan", "spec")

    def __init__(
        self, executor: Executor, job: Job, body: Callable[[JobContext], Any] | None
    ) -> None:
        self.executor = executor
        self.job = job
        self.spec = job.spec  # what a middleware sees of the delivery (middleware.Delivery)
        self.body = body
        self.plan = executor._plan  # who is called at each hook (less those that left)

    def leave(self, middleware: Middleware) -> None:
        """`middleware` wants nothing more of this delivery: no event, no end, no around
        hook (a tracer whose span records nothing)."""
        plan = self.plan
        after = plan.without.get(middleware)
        if after is None:
            after = plan.without[middleware] = self.executor.plan_without(plan.left | {middleware})
        self.plan = after

    def execute(self, op: StoreOp | ShellOp) -> Any:
        kind = type(op)
        if kind is Event:  # a third of a job's ops, most often told to one or two
            told = self.plan.handlers[op.kind]  # type: ignore[union-attr]
            if told:
                self.tell(op, told)  # type: ignore[arg-type]
            return None
        shell_op = _SHELL_OPS.get(kind)
        if shell_op is not None:
            return shell_op(self, op)
        return self.executor.backend.execute(op)  # type: ignore[arg-type]

    def tell(self, event: Event, told: tuple[Handler, ...] | None = None) -> None:
        """Hand `event` and its table row to every middleware that wants its kind (`told`,
        where the caller looked them up)."""
        if told is None:
            told = self.plan.handlers[event.kind]
        row = TABLE[event.kind]
        for on_event in told:
            try:
                on_event(self, event, row)
            except Exception:  # an observer must never change the job's fate
                log.exception("executor middleware %s failed on %s",
                              type(on_event.__self__).__name__, event.kind)  # type: ignore[attr-defined]  # fmt: skip

    def run_body(self, ctx: JobContext) -> Any:
        """The body as the current job, inside every middleware's `around_body`."""
        call: Callable[[JobContext], Any] = self.call_body
        for m in reversed(self.plan.bodies):
            call = partial(m.around_body, self, body=call)
        return call(ctx)

    def commit(self, op: Commit) -> Any:
        """One commit, inside every middleware's `around_commit`."""
        send: Callable[[Commit], Any] = self.executor.backend.execute
        for m in reversed(self.plan.commits):
            send = partial(m.around_commit, self, send=send)
        return send(op)

    def drop(self, op: Drop) -> None:
        self.executor.keeper.drop(op.lease)

    def call_body(self, ctx: JobContext) -> Any:
        assert self.body is not None, "RunBody from a flow that runs no body"
        # The context is frozen for the body; its way to give the lease back early (a
        # retry) is the shell's to set: the job's own flow, driven here.
        object.__setattr__(ctx, "let_go", partial(self.let_go, ctx.lease))
        token = set_current(ctx)
        try:
            return self.body(ctx)
        finally:
            reset_current(token)

    def let_go(self, lease: Lease) -> None:
        """The job's `let_go` flow (its lease released early), its events told as any."""
        run_sync(cast("Flow[None]", self.job.let_go(lease)), self, self.executor.backend.clock)

    def keep(self, op: Keep) -> None:
        self.executor.keeper.keep(op.lease, watch=op.watch)
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


#: The shell's own ops (not a round trip): what `_Shell.execute` does with each.
_SHELL_OPS: dict[type, Callable[[_Shell, Any], Any]] = {
    RunBody: lambda shell, op: shell.run_body(op.ctx),
    Keep: _Shell.keep,
    Drop: _Shell.drop,
    AfterOuterCommit: _Shell.after_outer_commit,
    Commit: _Shell.commit,
}
