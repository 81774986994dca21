"""OpenTelemetry spans of a gated job on a real Celery worker under the Celery instrumentation:
`run/<task>` holds `jobfence.job`, and in it `jobfence.acquire`, `jobfence.body` and
`jobfence.commit` in order, with the decision, fence and key hash, never an argument; and
without opentelemetry installed, tracing is a no-op that imports nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.instrumentation.celery")

from celery import Celery
from celery.contrib.testing.worker import start_worker
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from jobfence import singleton_task
from jobfence.config import Settings
from jobfence.locks import Backoff, LeaseKeeper, MemoryBackend, StaleFence
from jobfence.tasks import Executor, JobContext, install
from jobfence.tasks.errors import DuplicateSkipped, IdempotencyConflict
from jobfence.tasks.keys import job_key
from jobfence.tasks.tracing import key_hash
from tests.servers import RedisServer
from tests.tasks.conftest import spec_for, unique

#: An argument no span may carry (nor any digest-free form of it).
CARD = "card-4111-tracing-7f3a9c"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The SDK with an in-memory exporter, and the Celery instrumentation, for this module."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # set once per process (the API's rule)
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
    instrumentor.instrument()
    yield spans
    instrumentor.uninstrument()
    spans.shutdown()  # the processor stays on the provider; a shut exporter keeps nothing


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


class Shop:
    """A Celery app on the memory broker with a jobfence runtime on the private Redis, a
    gated task whose body can be held, and a real worker (two threads) running it."""

    def __init__(self, redis_url: str) -> None:
        self.app = Celery(unique("tracing"), set_as_current=False)
        self.app.conf.update(broker_url="memory://", result_backend="cache+memory://",
                             broker_transport_options={"polling_interval": 0.05},
                             task_serializer="json", accept_content=["json"])  # fmt: skip
        self.runtime = install(self.app, Settings(lock_url=redis_url))
        self.started = threading.Event()
        self.hold = threading.Event()
        self.hold.set()
        self.runs: list[str] = []

        @singleton_task(app=self.app, key="order_id", name=f"{self.app.main}.charge")
        def charge(order_id: int, card: str) -> int:
            self.runs.append(card)
            self.started.set()
            assert self.hold.wait(30), "the test never let the body finish"
            return order_id

        @singleton_task(app=self.app, key="order_id", name=f"{self.app.main}.refund")
        def refund(order_id: int, card: str) -> None:
            raise ValueError(f"no refund to {card}")

        self.charge = charge
        self.refund = refund


@pytest.fixture(scope="module")
def worker_shop(redis_server: RedisServer) -> Iterator[Shop]:
    """One worker for the module (its shutdown takes seconds); each test uses other orders."""
    made = Shop(redis_server.url)
    with start_worker(made.app, pool="threads", concurrency=2, perform_ping_check=False,
                      loglevel="WARNING"):  # fmt: skip
        yield made
    made.runtime.close()
    made.app.close()


@pytest.fixture
def shop(worker_shop: Shop) -> Shop:
    worker_shop.runs.clear()
    worker_shop.started.clear()
    worker_shop.hold.set()
    return worker_shop


def finished(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    return list(spans.get_finished_spans())


def run_span(all_spans: list[ReadableSpan], task_id: str) -> ReadableSpan:
    """The Celery instrumentation's `run/<task>` span of one delivery."""
    (found,) = [s for s in all_spans if s.name.startswith("run/")
                and (s.attributes or {}).get("messaging.message.id") == task_id]  # fmt: skip
    return found


def children(all_spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    """Spans whose parent is `parent`, in the order they started."""
    assert parent.context is not None
    mine = [s for s in all_spans if s.parent is not None
            and s.parent.span_id == parent.context.span_id]  # fmt: skip
    return sorted(mine, key=lambda s: s.start_time or 0)


def start(span: ReadableSpan) -> int:
    assert span.start_time is not None
    return span.start_time


def end(span: ReadableSpan) -> int:
    assert span.end_time is not None
    return span.end_time


def test_a_gated_job_traces_acquire_body_and_commit_in_order_under_the_celery_span(
    shop: Shop, spans: InMemorySpanExporter
) -> None:
    result = shop.charge.delay(7, CARD)
    assert result.get(timeout=30) == 7
    all_spans = finished(spans)

    run = run_span(all_spans, result.id)
    (job,) = children(all_spans, run)
    acquire, body, commit = children(all_spans, job)
    assert [job.name, acquire.name, body.name, commit.name] == [
        "jobfence.job", "jobfence.acquire", "jobfence.body", "jobfence.commit",
    ]  # fmt: skip
    assert start(run) <= start(job) <= start(acquire) <= end(acquire) <= start(body)
    assert end(body) <= start(commit) <= end(commit) <= end(job) <= end(run)

    fence = (job.attributes or {})["jobfence.fence"]
    assert isinstance(fence, int) and fence > 0
    key = job_key(shop.runtime.secret, shop.charge.name, {"order_id": 7}, selector="order_id")
    assert dict(job.attributes or {}) == {
        "jobfence.task": shop.charge.name,
        "jobfence.key_hash": key_hash(key),
        "jobfence.decision": "granted",
        "jobfence.wait_ms": (acquire.attributes or {})["jobfence.wait_ms"],
        "jobfence.fence": fence,
        "jobfence.outcome": "ran",
    }
    assert (acquire.attributes or {})["jobfence.decision"] == "granted"
    assert (acquire.attributes or {})["jobfence.fence"] == fence
    assert (body.attributes or {})["jobfence.fence"] == fence
    assert dict(commit.attributes or {}) == {
        "jobfence.fence": fence, "jobfence.state": "DONE", "jobfence.stored": True,
    }  # fmt: skip
    assert len({s.context.trace_id for s in (run, job, acquire, body, commit) if s.context}) == 1


def test_a_duplicate_is_traced_as_such_with_no_body_span(
    shop: Shop, spans: InMemorySpanExporter
) -> None:
    shop.hold.clear()
    first = shop.charge.delay(8, CARD)
    assert shop.started.wait(30), "the first copy never started"
    copy = shop.charge.delay(8, CARD)
    try:
        with pytest.raises(DuplicateSkipped):  # what a worker's copy answers with
            copy.get(timeout=30)
    finally:
        shop.hold.set()
    assert first.get(timeout=30) == 8
    all_spans = finished(spans)

    (job,) = children(all_spans, run_span(all_spans, copy.id))
    (acquire,) = children(all_spans, job)  # no body, no commit
    assert acquire.name == "jobfence.acquire"
    assert (acquire.attributes or {})["jobfence.decision"] == "duplicate"
    assert (job.attributes or {})["jobfence.decision"] == "duplicate"
    assert (job.attributes or {})["jobfence.outcome"] == "duplicate"
    assert "jobfence.conflict" in [e.name for e in job.events]
    ran = children(all_spans, children(all_spans, run_span(all_spans, first.id))[0])
    assert [s.name for s in ran] == ["jobfence.acquire", "jobfence.body", "jobfence.commit"]
    assert shop.runs == [CARD]


def test_no_span_carries_an_argument(shop: Shop, spans: InMemorySpanExporter) -> None:
    assert shop.charge.delay(9, CARD).get(timeout=30) == 9
    assert shop.charge.delay(9, CARD).get(timeout=30) == 9  # replayed
    all_spans = finished(spans)
    ours = [s for s in all_spans if s.name.startswith("jobfence.")]
    assert {s.name for s in ours} >= {"jobfence.job", "jobfence.acquire", "jobfence.body"}

    def texts(span: ReadableSpan) -> Iterator[str]:
        yield span.name
        for value in (span.attributes or {}).values():
            yield str(value)
        for event in span.events:
            yield event.name
            yield from (str(v) for v in (event.attributes or {}).values())

    seen = [text for span in all_spans for text in texts(span)]
    assert not [text for text in seen if CARD in text]
    assert not [text for text in seen if text == "9"]  # nor the other argument, as a value


def test_a_failing_body_marks_its_span_by_the_error_type_only(
    shop: Shop, spans: InMemorySpanExporter
) -> None:
    result = shop.refund.delay(3, CARD)
    with pytest.raises(ValueError, match="no refund"):
        result.get(timeout=30)
    all_spans = finished(spans)
    (job,) = children(all_spans, run_span(all_spans, result.id))
    _, body, commit = children(all_spans, job)
    assert body.status.description == "ValueError"
    assert (body.attributes or {})["jobfence.error"] == "ValueError"
    assert (commit.attributes or {})["jobfence.state"] == "FAILED"
    assert (job.attributes or {})["jobfence.outcome"] == "failed"
    ours = [s for s in all_spans if s.name.startswith("jobfence.")]
    assert not [s for s in ours if CARD in str(s.status.description) + str(s.events)]


@pytest.fixture
def executor(spans: InMemorySpanExporter) -> Iterator[Executor]:
    """An executor on the in-process lock server, traced by the module's SDK."""
    keeper = LeaseKeeper()
    yield Executor(MemoryBackend(), keeper, backoff=Backoff())
    keeper.stop()


def ours(spans: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    """This test's jobfence spans by name (one delivery each)."""
    found = {s.name: s for s in spans.get_finished_spans() if s.name.startswith("jobfence.")}
    return found


def test_a_stale_write_in_the_body_is_granted_then_superseded(
    executor: Executor, spans: InMemorySpanExporter
) -> None:
    def body(ctx: JobContext) -> None:
        raise StaleFence(resource="payment:1", fence=ctx.lease.fence, last=ctx.lease.fence + 1)

    out = executor.run(spec_for(unique()), body)
    assert out.status == "superseded"
    found = ours(spans)
    assert set(found) == {"jobfence.job", "jobfence.acquire", "jobfence.body"}  # no commit
    job = found["jobfence.job"].attributes or {}
    assert (job["jobfence.decision"], job["jobfence.outcome"]) == ("granted", "superseded")
    assert "jobfence.stale" in [e.name for e in found["jobfence.job"].events]
    assert found["jobfence.body"].status.description == "StaleFence"


def test_a_conflicting_reuse_of_a_key_is_a_conflict_named_by_its_error_type(
    executor: Executor, spans: InMemorySpanExporter
) -> None:
    key = unique()
    assert executor.run(spec_for(key), lambda ctx: 1).status == "ran"
    spans.clear()
    with pytest.raises(IdempotencyConflict):
        executor.run(spec_for(key, fingerprint="other arguments"), lambda ctx: 1)
    found = ours(spans)
    assert set(found) == {"jobfence.job", "jobfence.acquire"}
    job = found["jobfence.job"]
    assert (job.attributes or {})["jobfence.decision"] == "conflict"
    assert (job.attributes or {})["jobfence.outcome"] == "conflict"
    assert (job.status.status_code, job.status.description) == (
        StatusCode.ERROR, "IdempotencyConflict",
    )  # fmt: skip


NO_OTEL = textwrap.dedent(
    """
    import sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError("blocked: " + name)
            return None

    sys.meta_path.insert(0, Blocked())
    from jobfence.locks import Backoff, LeaseKeeper, MemoryBackend
    from jobfence.tasks import Executor, JobSpec
    from jobfence.tasks.tracing import job_tracer

    keeper = LeaseKeeper()
    executor = Executor(MemoryBackend(), keeper, backoff=Backoff())
    spec = JobSpec(name="t", key="t:k", fingerprint="f", ttl=30.0, result_ttl=60.0)
    out = executor.run(spec, lambda ctx: 5)
    keeper.stop()
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
    print(job_tracer(), executor.tracer, out.status, out.value, loaded)
    """
)


def test_without_opentelemetry_tracing_is_a_no_op_that_imports_nothing() -> None:
    done = subprocess.run([sys.executable, "-c", NO_OTEL], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.split() == ["None", "None", "ran", "5", "[]"]
