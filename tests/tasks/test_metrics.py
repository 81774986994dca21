"""Prometheus metrics of a Runtime on real lock servers: Redis, and PostgreSQL and MariaDB."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import generate_latest

from jobfence.config import Settings
from jobfence.locks import AcquireTimeout, Lease, SqlFenceGuard, open_backend
from jobfence.tasks import JobContext, Runtime
from tests.servers import wait_for
from tests.tasks.conftest import spec_for, unique

TTL = 1.5  # the keeper extends every 0.5 s


@pytest.fixture(params=["redis", "postgres", "mariadb"])
def lock_url(request: pytest.FixtureRequest) -> str:
    fixture = {"redis": "redis_url", "postgres": "pg_url", "mariadb": "mariadb_url"}
    url: str = request.getfixturevalue(fixture[request.param])
    return url


@pytest.fixture
def settings(lock_url: str) -> Settings:
    return Settings(
        lock_url=lock_url,
        key_prefix=f"mt{uuid.uuid4().hex[:8]}",  # the SQL databases live for the session
        default_ttl=TTL,
        socket_timeout=0.5,
        backoff_base=0.005,
        backoff_cap=0.05,
    )


@pytest.fixture
def runtime(settings: Settings) -> Iterator[Runtime]:
    """The Runtime @singleton_task uses: backend, keeper and executor wired to its metrics."""
    rt = Runtime(settings)
    yield rt
    rt.close()


@pytest.fixture
def other(settings: Settings) -> Iterator[Any]:
    """Another client of the same lock server: another worker, or an operator."""
    backend = open_backend(settings.lock_url, prefix=settings.key_prefix, socket_timeout=0.5)
    yield backend
    backend.close()


def sample(rt: Runtime, name: str, **labels: str) -> float:
    return rt.metrics.registry.get_sample_value(name, labels) or 0.0


def test_runs_replays_and_skipped_duplicates_are_counted(runtime: Runtime, other: Any) -> None:
    key = unique()
    assert runtime.executor.run(spec_for(key), lambda ctx: "paid").status == "ran"
    assert runtime.executor.run(spec_for(key), lambda ctx: "again").status == "replayed"
    busy = unique()
    holder = other.begin(busy, 30.0, record=True, fingerprint="fp-" + busy)
    assert isinstance(holder, Lease)
    assert runtime.executor.run(spec_for(busy), lambda ctx: "never").status == "duplicate"
    assert sample(runtime, "jobfence_executions_total", task="tests.job", outcome="done") == 1
    assert sample(runtime, "jobfence_idempotent_replays_total", task="tests.job") == 1
    assert sample(runtime, "jobfence_conflicts_total", task="tests.job", policy="skip") == 1
    assert sample(runtime, "jobfence_acquire_wait_seconds_count", task="tests.job") == 1


def test_a_waiter_records_how_long_it_waited(runtime: Runtime, other: Any) -> None:
    key = unique()
    holder = other.begin(key, 30.0, record=True, fingerprint="fp-" + key)
    assert isinstance(holder, Lease)
    outcome: list[Any] = []
    waiter = threading.Thread(
        target=lambda: outcome.append(
            runtime.executor.run(spec_for(key, on_conflict="wait"), lambda ctx: ctx.fence)
        )
    )
    waiter.start()
    wait_for(
        lambda: sample(runtime, "jobfence_conflicts_total", task="tests.job", policy="wait"),
        timeout=10,
        message="the waiter never found the key busy",
    )
    seen = time.monotonic()  # the waiter's first attempt was before this
    time.sleep(0.05)  # the holder works on a little longer
    released = time.monotonic()
    assert holder.release()  # no record: the waiter takes the key and runs the job
    waiter.join(10)
    assert outcome and outcome[0].status == "ran" and outcome[0].value > holder.fence
    waited = sample(runtime, "jobfence_acquire_wait_seconds_sum", task="tests.job")
    assert sample(runtime, "jobfence_acquire_wait_seconds_count", task="tests.job") == 1
    assert waited >= released - seen  # from its first attempt to the grant


def test_a_wait_that_gives_up_counts_a_timeout(runtime: Runtime, other: Any) -> None:
    key = unique()
    holder = other.begin(key, 30.0, record=True, fingerprint="fp-" + key)
    assert isinstance(holder, Lease)
    with pytest.raises(AcquireTimeout):
        runtime.executor.run(spec_for(key, on_conflict="wait", wait_timeout=0.2), lambda c: 1)
    assert sample(runtime, "jobfence_acquire_timeouts_total", task="tests.job") == 1
    assert sample(runtime, "jobfence_acquire_wait_seconds_count", task="tests.job") == 0


def test_a_write_refused_for_a_stale_fence_is_counted(runtime: Runtime, sqlite_url: str) -> None:
    engine = sa.create_engine(sqlite_url)
    guard = SqlFenceGuard()
    guard.create_schema(engine)
    key = unique()

    def body(ctx: JobContext) -> str:
        with engine.begin() as conn:  # a newer holder of this job wrote first
            guard.check_and_advance(conn, "acct:1", ctx.fence + 1)
        with guard.transaction(engine, "acct:1", ctx.fence):
            return "written"

    try:
        assert runtime.executor.run(spec_for(key), body).status == "superseded"
    finally:
        engine.dispose()
    assert sample(runtime, "jobfence_stale_fence_total", task="tests.job") == 1
    assert sample(runtime, "jobfence_executions_total", task="tests.job", outcome="superseded") == 1


def test_heartbeats_and_a_lost_lease_are_counted(runtime: Runtime, other: Any) -> None:
    backend_name = runtime.backend.name
    key = unique()

    def body(ctx: JobContext) -> None:
        wait_for(
            lambda: sample(runtime, "jobfence_heartbeat_seconds_count", backend=backend_name),
            timeout=5 * TTL,
            message="no heartbeat observed",
        )
        assert other.force_release(key)  # an operator takes the lock away
        wait_for(lambda: ctx.lease.lost, timeout=5 * TTL, message="the loss went unnoticed")
        ctx.lease.check()  # raises LeaseLost, as a fenced write or check in a body would

    outcome = runtime.executor.run(spec_for(key, ttl=TTL), body)
    assert outcome.status == "redeliver"  # lost, and no newer holder in sight
    assert sample(runtime, "jobfence_lost_leases_total") == 1
    assert sample(runtime, "jobfence_executions_total", task="tests.job", outcome="lease_lost") == 1
    assert sample(runtime, "jobfence_heartbeat_seconds_count", backend=backend_name) >= 1
    # Scrapeable: the text exposition names the backend the heartbeats went to.
    text = generate_latest(runtime.metrics.registry).decode()
    assert f'jobfence_heartbeat_seconds_count{{backend="{backend_name}"}}' in text
    assert "jobfence_lost_leases_total 1.0" in text
