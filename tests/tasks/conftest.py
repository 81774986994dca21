"""Fixtures for task-layer tests: lock backends, an executor, SQL URLs and Celery apps."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from jobfence.config import Settings
from jobfence.locks import (
    SYSTEM_CLOCK,
    Backoff,
    Lease,
    LeaseKeeper,
    LockBackend,
    MemoryBackend,
    RedisBackend,
)
from jobfence.tasks import Executor, JobContext, JobSpec, Runtime, SqlEffects, install, make_engine
from jobfence.tasks.metrics import Metrics


def unique(prefix: str = "job") -> str:
    """A name no other test uses (keys, resources, task names)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def spec_for(key: str, **overrides: Any) -> JobSpec:
    """A JobSpec with test-friendly defaults: long TTL, short waits."""
    fields: dict[str, Any] = {
        "name": "tests.job",
        "key": key,
        "fingerprint": "fp-" + key,
        "ttl": 30.0,
        "result_ttl": 600.0,
        "on_conflict": "skip",
        "wait_timeout": 5.0,
    }
    fields.update(overrides)
    return JobSpec(**fields)


_FAKE_HOLDER = MemoryBackend()  # never asked: the leases below are made, not granted


def job_with_fence(key: str, fence: int, fingerprint: str = "fp") -> JobContext:
    """A job context holding a lease with exactly this fence (as a lock server granted it)."""
    lease = Lease(
        key=key,
        owner="owner-" + key,
        fence=fence,
        ttl=30.0,
        deadline=SYSTEM_CLOCK.monotonic() + 30.0,
        backend=_FAKE_HOLDER,
        clock=SYSTEM_CLOCK,
    )
    return JobContext(key=key, fingerprint=fingerprint, lease=lease)


@contextlib.contextmanager
def sql_effects(url: str, *tables: sa.MetaData) -> Iterator[SqlEffects]:
    """SqlEffects on a new engine for `url`, with jobfence's tables and the test's own
    (`tables`) created; the engine is disposed of on exit."""
    engine = make_engine(url)
    effects = SqlEffects(engine)
    effects.create_schema()
    for metadata in tables:
        metadata.create_all(engine)
    try:
        yield effects
    finally:
        engine.dispose()


@pytest.fixture
def redis_backend(redis_url: str) -> Iterator[RedisBackend]:
    """A RedisBackend on the flushed private server."""
    backend = RedisBackend.from_url(redis_url, prefix="jobfence")
    yield backend
    backend.close()


@pytest.fixture
def other_redis_backend(redis_url: str) -> Iterator[RedisBackend]:
    """A second, independent client on the same server (another 'worker')."""
    backend = RedisBackend.from_url(redis_url, prefix="jobfence")
    yield backend
    backend.close()


@pytest.fixture
def postgres_backend(pg_url: str) -> Iterator[LockBackend]:
    """A PostgresBackend on the session's scratch database (keys are unique per test)."""
    from jobfence.locks.backends.postgres import PostgresBackend

    backend = PostgresBackend.from_url(pg_url, prefix="jobfence")
    yield backend
    backend.close()


@pytest.fixture
def mariadb_backend(mariadb_url: str) -> Iterator[LockBackend]:
    """A MySQLBackend on the session's scratch MariaDB database."""
    from jobfence.locks.backends.mysql import MySQLBackend

    backend = MySQLBackend.from_url(mariadb_url, prefix="jobfence")
    yield backend
    backend.close()


@pytest.fixture
def other_mariadb_backend(mariadb_url: str) -> Iterator[LockBackend]:
    """A second, independent MariaDB client (another 'worker')."""
    from jobfence.locks.backends.mysql import MySQLBackend

    backend = MySQLBackend.from_url(mariadb_url, prefix="jobfence")
    yield backend
    backend.close()


@pytest.fixture(params=["redis", "memory", "postgres", "mariadb"])
def backend(request: pytest.FixtureRequest) -> LockBackend:
    """Each executor test runs on real lock servers and on the in-process backend."""
    if request.param in ("redis", "postgres", "mariadb"):
        got: LockBackend = request.getfixturevalue(f"{request.param}_backend")
        return got
    return MemoryBackend()


@pytest.fixture
def keeper() -> Iterator[LeaseKeeper]:
    k = LeaseKeeper()
    yield k
    k.stop()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def executor(backend: LockBackend, keeper: LeaseKeeper, metrics: Metrics) -> Executor:
    return Executor(backend, keeper, backoff=Backoff(0.005, 0.05), metrics=metrics)


@pytest.fixture
def redis_executor(redis_backend: RedisBackend, keeper: LeaseKeeper, metrics: Metrics) -> Executor:
    return Executor(redis_backend, keeper, backoff=Backoff(0.005, 0.05), metrics=metrics)


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def sql_url(request: pytest.FixtureRequest) -> str:
    """The ledger database: SQLite file, scratch PostgreSQL, scratch MariaDB."""
    fixture = {"sqlite": "sqlite_url", "postgresql": "pg_url", "mariadb": "mariadb_url"}
    url: str = request.getfixturevalue(fixture[request.param])
    return url


AppFactory = Callable[..., Celery]


@pytest.fixture
def make_app(redis_url: str) -> Iterator[AppFactory]:
    """Builds Celery apps with a jobfence runtime on the private Redis; closes them after."""
    made: list[tuple[Celery, Runtime | None]] = []

    def factory(*, eager: bool = True, installed: bool = True, **settings: Any) -> Celery:
        """`eager=False` publishes to a Redis broker on the private server (no worker)."""
        app = Celery(unique("jobfence-tests"), set_as_current=False)
        app.conf.update(
            task_always_eager=eager,
            task_eager_propagates=True,
            task_serializer="json",
            result_serializer="json",
            accept_content=["json"],
            broker_url="memory://localhost/" if eager else redis_url,
            result_backend=None,
        )
        runtime = install(app, Settings(lock_url=redis_url, **settings)) if installed else None
        made.append((app, runtime))
        return app

    yield factory
    for app, runtime in made:
        if runtime is not None:
            runtime.close()
        app.close()
