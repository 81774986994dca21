"""Fixtures of the model test: one in-process worker per lock backend, on a private broker."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.contrib.testing.worker import start_worker

from tests.model.app import build_app
from tests.model.scenario import Harness
from tests.servers import RedisServer

#: Worker threads: enough for a sequence's jobs, slot waiters and retries at once.
WORKER_THREADS = 6


@pytest.fixture(scope="module")
def model_broker() -> Iterator[RedisServer]:
    """A private redis-server: the broker (db 0), results (db 1) and the body's records (db 2)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module", params=["memory", "redis"])
def harness(
    request: pytest.FixtureRequest,
    model_broker: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Harness]:
    """A real consumer (Celery's threads pool in this process) of the private broker, with
    locks in memory or on a private redis-server of their own (the faults pause and flush it)."""
    model_broker.client().flushall()
    database = Path(tmp_path_factory.mktemp(f"model-{request.param}")) / "effects.db"
    env = {
        "BROKER_URL": model_broker.db_url(0),
        "RESULT_BACKEND": model_broker.db_url(1),
        "LEDGER_URL": model_broker.db_url(2),
    }
    with RedisServer() as locks:
        lock_url = "memory://" if request.param == "memory" else locks.db_url(0)
        model = build_app(env, lock_url=lock_url, database_url=f"sqlite:///{database}")
        with start_worker(
            model.app, pool="threads", concurrency=WORKER_THREADS, perform_ping_check=False,
            loglevel="WARNING", shutdown_timeout=30.0,
        ):  # fmt: skip
            yield Harness(
                model, request.param, model_broker, locks if request.param == "redis" else None
            )
            # The publishes' AsyncResults unsubscribe from the result store when collected:
            # let them do it while it still runs.
            gc.collect()
        model.engine.dispose()
