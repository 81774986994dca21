"""Observers of job deliveries as middleware: one concern each, every hook a no-op by default.

The executor's shell hands each event a flow yields (tasks/events.py) to every middleware
that wants its kind, with its `TABLE` row, and tells each when a delivery ends; around hooks
wrap a delivery, its body and its commits (the spans). `standard()` is the one list the
runtime registers; a new observer is one class here (or a plain callable, see `Observers`).
An event or end hook that raises is logged and skipped (an observer never changes a job's
fate); an around hook must call on, as the shell would have. State a middleware keeps per
delivery is keyed by the delivery's id while it runs (deliveries run on many threads).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from jobfence.locks.decisions import Decision
from jobfence.locks.outage import OUTAGE as OUTAGE_LIMITER
from jobfence.locks.outage import WarningLimiter
from jobfence.tasks.events import OUTAGE, TABLE, Event, Kind, Row, fields

if TYPE_CHECKING:
    from jobfence.locks.ops import Commit
    from jobfence.tasks.context import JobContext
    from jobfence.tasks.decisions import DecisionRecorder
    from jobfence.tasks.lifecycle import JobSpec
    from jobfence.tasks.metrics import Metrics
    from jobfence.tasks.tracing import JobTrace, JobTracer

# The job flow's log lines keep the executor's logger: operators' filters and tests name it.
log = logging.getLogger("jobfence.tasks.executor")
T = TypeVar("T")
#: A plain-callable observer (the demo's journal, tests): event name, job, fence.
Observer = Callable[[str, "JobSpec", int | None], None]


class Delivery(Protocol):
    """What a middleware sees of one delivery (the executor's shell, one per flow run)."""

    @property
    def spec(self) -> JobSpec: ...


class Running(Delivery, Protocol):
    """A delivery as its `around_run` hooks see it: one may leave it (nothing more of it
    is told to that middleware, none of its other hooks called for it)."""

    def leave(self, middleware: Middleware) -> None: ...


class Middleware:
    """One concern observing deliveries. Override what it needs; the rest does nothing.

    `routine`: it wants the routine events a flow skips when nobody listens ("started").
    """

    routine = False

    def wants(self, row: Row) -> bool:
        """Whether it is told of events of `row`'s kind (asked once, at registration)."""
        return True

    def on_event(self, delivery: Delivery, event: Event, row: Row) -> None:
        """`event` happened in `delivery`; `row` is its line in the events table."""

    def after_delivery(self, delivery: Delivery) -> None:
        """`delivery`'s flow ended (returned or raised)."""

    def close(self) -> None:
        """The runtime closes: write out what is pending."""

    # Around hooks wrap what the shell does (they must call on): a tracer's spans.
    def around_run(self, delivery: Running, run: Callable[[], T]) -> T:
        """Around one whole delivery (`Executor.deliver`): its verdict is `run()`'s."""
        return run()

    def around_body(
        self, delivery: Delivery, ctx: JobContext, body: Callable[[JobContext], Any]
    ) -> Any:
        """Around the job's body: its value is `body(ctx)`'s."""
        return body(ctx)

    def around_commit(self, delivery: Delivery, op: Commit, send: Callable[[Commit], Any]) -> Any:
        """Around one commit sent to the lock server: its reply is `send(op)`'s."""
        return send(op)


def overrides(middleware: Middleware, hook: str) -> bool:
    """Whether `middleware` does something at `hook` (the shell calls only those)."""
    return getattr(type(middleware), hook) is not getattr(Middleware, hook)


Handler = Callable[[Delivery, Event, Row], None]


def handlers(middleware: Sequence[Middleware]) -> dict[Kind, tuple[Handler, ...]]:
    """Per kind of event, the `on_event` of each middleware that wants it, in order: the
    shell's dispatch (a job that runs tells two events, each to its one or two listeners)."""
    listening = [m for m in middleware if overrides(m, "on_event")]
    return {kind: tuple(m.on_event for m in listening if m.wants(row))
            for kind, row in TABLE.items()}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Plan:
    """Who the shell calls at each hook of one delivery: the registered middleware that
    override it, in order, less those that left the delivery (`left`)."""

    handlers: dict[Kind, tuple[Handler, ...]]
    ending: tuple[Middleware, ...]
    bodies: tuple[Middleware, ...]
    commits: tuple[Middleware, ...]
    left: frozenset[Middleware]
    #: The plan once one more middleware left, by that middleware (filled as they leave).
    without: dict[Middleware, Plan] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, middleware: Sequence[Middleware], left: frozenset[Middleware]) -> Plan:
        def hooked(hook: str) -> tuple[Middleware, ...]:
            return tuple(m for m in middleware if overrides(m, hook))

        return cls(handlers(middleware), hooked("after_delivery"), hooked("around_body"),
                   hooked("around_commit"), left)  # fmt: skip


class LogLines(Middleware):
    """The job's log lines (logger `jobfence.tasks.executor`): each row's line at its level
    (an outage's warnings are `OutageLines`')."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self.log = logger

    def wants(self, row: Row) -> bool:
        return row.level not in (0, OUTAGE)

    def on_event(self, delivery: Delivery, event: Event, row: Row) -> None:
        if self.log.isEnabledFor(row.level):
            self.log.log(row.level, row.line, fields(delivery.spec, event))


class OutageLines(Middleware):
    """A lock-server outage's warnings, through a limiter shared with the keeper and beat
    (locks/outage.py): a few lines, then one summary with the count."""

    def __init__(self, limiter: WarningLimiter = OUTAGE_LIMITER, logger: logging.Logger = log):
        self.limiter = limiter
        self.log = logger

    def wants(self, row: Row) -> bool:
        return row.level == OUTAGE

    def on_event(self, delivery: Delivery, event: Event, row: Row) -> None:
        self.limiter.warning(self.log, row.line, fields(delivery.spec, event))

    def close(self) -> None:
        self.limiter.flush()  # the count of warnings an outage had suppressed, not lost


class Counting(Middleware):
    """The job's Prometheus metrics (tasks/metrics.py): each row's update."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def wants(self, row: Row) -> bool:
        return row.metric is not None

    def on_event(self, delivery: Delivery, event: Event, row: Row) -> None:
        row.metric(self.metrics, delivery.spec, event)  # type: ignore[misc]


class Decisions(Middleware):
    """The decision log (tasks/decisions.py): a delivery's decisions, handed to the recorder
    once, when it ends (logged, and stored by a writer thread)."""

    routine = True

    def __init__(self, recorder: DecisionRecorder) -> None:
        self.recorder = recorder
        # By delivery, until it ends: each decision's time, event and name (its Decision
        # built at the end, only for those the log keeps).
        self._open: dict[int, list[tuple[float, Event, str]]] = {}

    def wants(self, row: Row) -> bool:
        return row.decision is not None

    def on_event(self, delivery: Delivery, event: Event, row: Row) -> None:
        told = (time.time(), event, row.decision or "")
        found = self._open.get(id(delivery))
        if found is None:
            self._open[id(delivery)] = [told]
        else:
            found.append(told)

    def after_delivery(self, delivery: Delivery) -> None:
        told = self._open.pop(id(delivery), None)
        if not told:
            return
        if len(told) == 2 and told[0][2] == "started" and told[1][2] in ("done", "failed"):
            del told[0]  # a plain run: its end says it was granted
        spec = delivery.spec
        self.recorder.record([Decision(at, name, spec.key, spec.name, spec.task_id, e.fence,
                                       e.holder, e.newer, e.reason)
                              for at, e, name in told])  # fmt: skip

    def close(self) -> None:
        self.recorder.close()  # the decisions still pending, stored


class Observers(Middleware):
    """Plain callables told of every decision by name (`Observer`); one that raises is
    logged and the others are still told."""

    routine = True

    def __init__(self) -> None:
        self.observers: list[Observer] = []

    def wants(self, row: Row) -> bool:
        return row.decision is not None

    def on_event(self, delivery: Delivery, event: Event, row: Row) -> None:
        for observe in self.observers:
            try:
                observe(row.decision or "", delivery.spec, event.fence)
            except Exception:
                log.exception("executor observer failed on %s", row.decision)


class Tracing(Middleware):
    """A delivery's OpenTelemetry spans (tasks/tracing.py): the job, the gate, the body and
    each commit, every decision an event on the job span. A delivery whose span records
    nothing (no SDK, sampled out) runs as if untraced."""

    def __init__(self, tracer: JobTracer) -> None:
        self.tracer = tracer
        self._traces: dict[int, JobTrace] = {}  # by delivery, while it runs

    def wants(self, row: Row) -> bool:
        return row.span is not None or row.ends

    def around_run(self, delivery: Running, run: Callable[[], T]) -> T:
        trace = self.tracer.start(delivery.spec)
        if trace is None:  # nothing recorded: no event, body or commit of it is this one's
            delivery.leave(self)
            return run()
        self._traces[id(delivery)] = trace
        try:
            with trace:
                return run()
        finally:
            del self._traces[id(delivery)]

    def around_body(
        self, delivery: Delivery, ctx: JobContext, body: Callable[[JobContext], Any]
    ) -> Any:
        trace = self._traces.get(id(delivery))
        return body(ctx) if trace is None else trace.body(ctx, body)

    def around_commit(self, delivery: Delivery, op: Commit, send: Callable[[Commit], Any]) -> Any:
        trace = self._traces.get(id(delivery))
        return send(op) if trace is None else trace.commit(op, send)

    def on_event(self, delivery: Delivery, event: Event, row: Row) -> None:
        trace = self._traces.get(id(delivery))
        if trace is None:
            return
        if row.ends:
            trace.outcome(event.reason, event.fence)
        else:
            trace.note(row.span or "", event.fence)


def standard(
    metrics: Metrics, recorder: DecisionRecorder | None = None, tracer: JobTracer | None = None
) -> list[Middleware]:
    """The runtime's middleware, in order: log lines, outage warnings, metrics, the decision
    log if kept, and spans where opentelemetry-api is installed."""
    found: list[Middleware] = [LogLines(), OutageLines(), Counting(metrics)]
    if recorder is not None:
        found.append(Decisions(recorder))
    if tracer is not None:
        found.append(Tracing(tracer))
    return found
