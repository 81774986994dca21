"""OpenTelemetry spans of one delivery: the gate's wait and decision, the body, the commit.

`job_tracer()` is None where opentelemetry-api is not installed (nothing imported, nothing
done). Where it is, a delivery opens `jobfence.job` under the current span (the Celery
instrumentation's `run/<task>`), and under it `jobfence.acquire` (from the start until the
body runs: the lease, its waits and retries, the publish claim, the rate turn, the slot),
`jobfence.body` (the current span while the body runs) and one `jobfence.commit` per commit
sent. Attributes name the task, a hash of the job key, the fence and the decision; never an
argument, a result or an error message (only an exception's type).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jobfence.locks.errors import AcquireTimeout
from jobfence.tasks.errors import DuplicateJob, IdempotencyConflict, PoisonMessage
from jobfence.tasks.lifecycle import RedeliveryLimitReached

if TYPE_CHECKING:
    from types import TracebackType

    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from jobfence.locks.ops import Commit
    from jobfence.tasks.context import JobContext
    from jobfence.tasks.lifecycle import JobSpec

TRACER_NAME = "jobfence"
JOB_SPAN = "jobfence.job"
ACQUIRE_SPAN = "jobfence.acquire"
BODY_SPAN = "jobfence.body"
COMMIT_SPAN = "jobfence.commit"


def job_tracer() -> JobTracer | None:
    """The executor's tracer, or None where opentelemetry-api is not installed."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    from jobfence import __version__

    return JobTracer(trace.get_tracer(TRACER_NAME, __version__))


def key_hash(key: str) -> str:
    """What a span says of a job key: a digest (the key holds an HMAC of arguments; this
    names the job in a trace, is equal for equal keys, and tells nothing more)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def decision_of(exc: BaseException) -> str:
    """The gate's decision when it raised instead of returning an outcome."""
    if isinstance(exc, IdempotencyConflict):
        return "conflict"
    if isinstance(exc, DuplicateJob):  # on_conflict="raise"
        return "duplicate"
    if isinstance(exc, AcquireTimeout):  # on_conflict="wait", past wait_timeout
        return "timeout"
    if isinstance(exc, RedeliveryLimitReached):
        return "given_up"
    if isinstance(exc, PoisonMessage):  # past max_crashed_deliveries
        return "poisoned"
    return "error"


class JobTracer:
    """Starts a `JobTrace` per delivery over an OpenTelemetry tracer (with no SDK set up,
    the API's no-op tracer: one span that records nothing, and no more work per job)."""

    def __init__(self, tracer: Tracer) -> None:
        from opentelemetry import context, trace

        self.tracer = tracer
        self._in_context = trace.set_span_in_context
        self._attach = context.attach
        self._detach = context.detach

    def start(self, spec: JobSpec) -> JobTrace | None:
        """The trace of one delivery, or None where its span records nothing (no SDK, or
        sampled out): then the delivery runs as if untraced."""
        span = self.tracer.start_span(JOB_SPAN)
        if not span.is_recording():
            return None
        span.set_attributes({"jobfence.task": spec.name, "jobfence.key_hash": key_hash(spec.key)})
        return JobTrace(self, span)


class JobTrace:
    """The spans of one delivery; the `Tracing` middleware (tasks/middleware.py) tells it of
    the body, each commit, each decision, and the outcome (the gate's decision is "granted"
    once the body runs)."""

    __slots__ = ("_context", "_event", "_gate", "_job", "_started", "_tracer", "decision")

    def __init__(self, tracer: JobTracer, job: Span) -> None:
        self._tracer = tracer
        self._job = job
        self._context: Context = tracer._in_context(job)
        self._gate: Span | None = tracer.tracer.start_span(ACQUIRE_SPAN, context=self._context)
        self._started = time.monotonic()
        self.decision = ""
        self._event = ""  # the last note: after the body, "failed" or "released"

    def __enter__(self) -> JobTrace:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            decided = self.decision or decision_of(exc)
            self._decide(decided)
            # Past the gate, the last note says how it ended ("failed", "released").
            ended = (self._event or "failed") if decided == "granted" else decided
            self._job.set_attribute("jobfence.outcome", ended)
            _error(self._job, exc)
        self._job.end()

    def outcome(self, status: str, fence: int | None) -> None:
        """Record what the delivery came to (`ran`, `replayed`, `duplicate`, ...)."""
        self._decide("granted" if status == "ran" else status)
        self._job.set_attribute("jobfence.outcome", status)
        if fence is not None:
            self._job.set_attribute("jobfence.fence", fence)

    def _decide(self, decision: str, fence: int | None = None) -> None:
        """End the gate (once) with its decision, the wait it took and the fence granted."""
        gate = self._gate
        if gate is None:
            return
        self._gate = None
        self.decision = decision
        attributes: dict[str, Any] = {
            "jobfence.decision": decision,
            "jobfence.wait_ms": round((time.monotonic() - self._started) * 1000, 3),
        }
        if fence is not None:
            attributes["jobfence.fence"] = fence
        gate.set_attributes(attributes)
        gate.end()
        self._job.set_attributes(attributes)

    def body(self, ctx: JobContext, run: Callable[[JobContext], Any]) -> Any:
        """Run the body as the current span `jobfence.body` (the user's spans nest under it)."""
        fence = ctx.lease.fence
        self._decide("granted", fence)
        span = self._tracer.tracer.start_span(
            BODY_SPAN, context=self._context, attributes={"jobfence.fence": fence}
        )
        token = self._tracer._attach(self._tracer._in_context(span, self._context))
        try:
            return run(ctx)
        except BaseException as exc:
            _error(span, exc)
            raise
        finally:
            self._tracer._detach(token)
            span.end()

    def commit(self, op: Commit, send: Callable[[Commit], Any]) -> Any:
        """Send one commit (the record and the release) inside a `jobfence.commit` span."""
        span = self._tracer.tracer.start_span(
            COMMIT_SPAN,
            context=self._context,
            attributes={"jobfence.fence": op.lease.fence, "jobfence.state": op.state},
        )
        try:
            stored = send(op)
        except BaseException as exc:
            _error(span, exc)
            raise
        else:
            span.set_attribute("jobfence.stored", bool(stored))
            return stored
        finally:
            span.end()

    def note(self, span: str, fence: int | None) -> None:
        """A decision (`jobfence.conflict`, `jobfence.defer`, `jobfence.lease_lost`, ...: its
        row's span in tasks/events.py) as an event on the job span."""
        self._event = span.removeprefix("jobfence.")
        self._job.add_event(span, {} if fence is None else {"jobfence.fence": fence})


def _error(span: Span, exc: BaseException) -> None:
    """Mark `span` failed by the exception's type; its message may hold arguments."""
    from opentelemetry.trace import Status, StatusCode

    name = type(exc).__name__
    span.set_attribute("jobfence.error", name)
    span.set_status(Status(StatusCode.ERROR, name))
