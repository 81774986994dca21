"""A user's app that touches PostgreSQL at import, so its engines exist before the pool forks.

Built from the variables of :mod:`tests.integration.apps.singleton_app` (``BROKER_URL``,
``LOCK_URL``, ``DATABASE_URL``, ...). At import, in the worker's main process, it does what a
user would: creates jobfence's tables through the runtime's engine, and its own table
through an engine of its own; each engine is left with an idle pooled connection that every
pool child inherits. Then two tasks write one row per call, with the pid of the worker
process and the PostgreSQL backend pid of the session they wrote through:

``fork.fenced(n)``
    A ``@singleton_task`` writing through ``SqlEffects`` (jobfence's engine).
``fork.naive(n)``
    The control: a plain Celery task writing through the app's own engine, built the same
    way (``pool_pre_ping``), which jobfence never sees.

Recorded at ``LEDGER_URL`` (Redis), per engine (``fenced`` is jobfence's, ``naive`` the app's):

:data:`PARENT_SESSIONS`
    Hash: the backend pid of the engine's idle pooled connection in the main process.
:data:`CHILDREN`
    List of JSON objects, one per pool child at ``worker_process_init`` (after fork):
    ``{"pid": ..., "fenced": n, "naive": n}``, n the idle connections its pool starts with.
:data:`INVALIDATED`
    List: ``"<engine>: <exception>"`` for every connection a pool threw away (a failed
    pre-ping or a disconnect).
:data:`FAILURES`
    List: ``"<task>: <exception>"`` for every task that failed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
import sqlalchemy as sa
from celery import signals

from jobfence.tasks import current_job, install, singleton_task
from tests.integration.apps.common import make_app
from tests.integration.apps.singleton_app import settings_from

__all__ = ["CHILDREN", "FAILURES", "INVALIDATED", "PARENT_SESSIONS", "app", "writes"]

FAILURES = "fork:failures"
PARENT_SESSIONS = "fork:parent-sessions"
CHILDREN = "fork:children"
INVALIDATED = "fork:invalidated"

metadata = sa.MetaData()
writes = sa.Table(
    "fork_writes",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("task", sa.String(32), nullable=False),
    sa.Column("n", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("backend_pid", sa.Integer, nullable=False),
)

app = make_app("fork", os.environ)
runtime = install(app, settings_from(os.environ))

# As a user would, at import: the schema through jobfence's engine, and the app's own.
runtime.effects.create_schema()
own_engine = sa.create_engine(os.environ["DATABASE_URL"], pool_pre_ping=True)
metadata.create_all(own_engine)


def _session_of(engine: sa.Engine) -> int:
    """The backend pid of the engine's pooled connection (checked out, then back in the pool)."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


_client: tuple[int, redis.Redis] | None = None


def ledger() -> redis.Redis:
    """This process's Redis client for the records (made after fork)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(os.environ["LEDGER_URL"]))
    return _client[1]


ENGINES = {"fenced": runtime.effects.engine, "naive": own_engine}
ledger().hset(PARENT_SESSIONS, mapping={k: _session_of(e) for k, e in ENGINES.items()})
ledger().close()


def _on_invalidate(name: str) -> Any:
    def record(_dbapi_conn: Any, _record: Any, exception: BaseException | None) -> None:
        ledger().rpush(INVALIDATED, f"{name}: {type(exception).__name__}: {exception}"[:300])

    return record


for _name, _engine in ENGINES.items():
    sa.event.listen(_engine, "invalidate", _on_invalidate(_name))


@signals.worker_process_init.connect
def _record_child(**_: Any) -> None:
    inherited = {name: e.pool.checkedin() for name, e in ENGINES.items()}  # type: ignore[attr-defined]
    ledger().rpush(CHILDREN, json.dumps({"pid": os.getpid(), **inherited}))


def _write(conn: sa.Connection, task: str, n: int) -> int:
    backend_pid = int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
    conn.execute(
        writes.insert().values(task=task, n=n, pid=os.getpid(), backend_pid=backend_pid)
    )
    return backend_pid


@singleton_task(app=app, name="fork.fenced", shared=False)
def fenced(n: int) -> int:
    job = current_job()
    with runtime.effects.transaction(job, f"job:{job.key}") as tx:
        if not tx.done:
            tx.result = _write(tx.conn, "fenced", n)
    return int(tx.result)


@app.task(name="fork.naive", shared=False)
def naive(n: int) -> int:
    with own_engine.begin() as conn:
        return _write(conn, "naive", n)


@signals.task_failure.connect
def _record_failure(sender: Any = None, exception: BaseException | None = None, **_: Any) -> None:
    name = getattr(sender, "name", "?")
    ledger().rpush(FAILURES, f"{name}: {type(exception).__name__}: {exception}"[:500])
