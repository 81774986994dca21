"""Fixtures of the model test: one in-process worker per lock backend, on a private broker."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery.contrib.testing.worker import start_worker
from sqlalchemy.pool import NullPool

from jobfence.tasks import runtime_for
from jobfence.tasks.outbox import SqlOutbox
from jobfence.worker import custody
from jobfence.worker.outbox_relay import OutboxRelay
from tests.model.app import ModelApp, build_app
from tests.model.scenario import Harness
from tests.model.second import SecondWorker
from tests.pg_cut import SessionCutter
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase, RedisServer

#: Worker threads: enough for a sequence's jobs, slot waiters and retries at once.
WORKER_THREADS = 6
#: Seconds a committed, unsent outbox row waits for its publisher before the relay sends it.
RELAY_GRACE = 0.3


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
    locks in memory or on a private redis-server of their own (the faults pause and flush it).
    The effects commit to SQLite (memory) or to a scratch PostgreSQL database whose sessions
    the ``cut_db`` step kills (redis; SQLite and no cuts where PostgreSQL does not answer)."""
    model_broker.client().flushall()
    database = Path(tmp_path_factory.mktemp(f"model-{request.param}")) / "effects.db"
    env = {
        "BROKER_URL": model_broker.db_url(0),
        "RESULT_BACKEND": model_broker.db_url(1),
        "LEDGER_URL": model_broker.db_url(2),
    }
    with ExitStack() as stack:
        locks = stack.enter_context(RedisServer())
        lock_url = "memory://" if request.param == "memory" else locks.db_url(0)
        database_url = f"sqlite:///{database}"
        if request.param == "redis" and PostgresDatabase.reachable(POSTGRES_ADMIN_URL) is None:
            database_url = stack.enter_context(PostgresDatabase(POSTGRES_ADMIN_URL)).url
        model = build_app(env, lock_url=lock_url, database_url=database_url)
        stack.callback(model.engine.dispose)
        cutter = None
        if model.engine.dialect.name == "postgresql":
            admin = sa.create_engine(database_url, poolclass=NullPool)
            stack.callback(admin.dispose)
            cutter = SessionCutter(model.engine, admin)
            stack.callback(cutter.close)
        second = None
        if request.param == "redis":
            second = _second_worker(model, env, lock_url, database_url, tmp_path_factory)
            stack.callback(second.stop)
        # The fleet's outbox relay (issue 34): sends what `on_commit` steps committed and
        # never published ("died"), after a grace shorter than any drain.
        relay = OutboxRelay(model.app, runtime_for(model.app), SqlOutbox(model.engine),
                            grace=RELAY_GRACE, poll=0.1, retention=3600.0, ttl=2.0).start()
        stack.callback(relay.stop)
        with start_worker(
            model.app, pool="threads", concurrency=WORKER_THREADS, perform_ping_check=False,
            loglevel="WARNING", shutdown_timeout=30.0,
        ):  # fmt: skip
            yield Harness(
                model, request.param, model_broker,
                locks if request.param == "redis" else None, cutter, second, relay,
            )  # fmt: skip
            # The publishes' AsyncResults unsubscribe from the result store when collected:
            # let them do it while it still runs.
            gc.collect()
        model.close()


def _second_worker(
    model: ModelApp,
    env: dict[str, str],
    lock_url: str,
    database_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> SecondWorker:
    """A second worker process on the same app, broker, locks and effects database (started
    on first use), and custody in this one too: each sweeps what the other left behind."""
    custody.connect(model.app)
    full = {**env, "LOCK_URL": lock_url, "DATABASE_URL": database_url}
    return SecondWorker(full, Path(tmp_path_factory.mktemp("model-second")))
