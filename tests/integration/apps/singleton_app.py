"""@singleton_task twins of the control tasks, on the same Celery config, recording into the Ledger.

Built from the variables of :mod:`tests.integration.apps.common`, plus:

``LOCK_URL``
    Redis URL of the jobfence lock backend (default: ``BROKER_URL``).
``DATABASE_URL``
    SQLAlchemy URL of the SQL ledger that ``singleton.sql_gated`` writes through ``SqlEffects``
    (create its tables first with :func:`create_schema`).
``LEASE_TTL``
    Lease TTL in seconds (default ``2``); the keeper extends every third of it.
``LOCK_SOCKET_TIMEOUT``
    Seconds a lock-server call may take (default ``0.5``; must stay below TTL - heartbeat).

``celery -A tests.integration.apps.singleton_app worker`` finds ``app``, built on first access
from ``os.environ``; a test process builds its own client with :func:`create_app`. Every
delivery of a ``singleton.*`` task, whether its body ran or not, appends its Celery state and
return value to the job's ``outcomes`` in the Ledger (``task_postrun``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from celery import Celery, Task, signals

from jobfence.config import Settings
from jobfence.locks.errors import StaleFence
from jobfence.tasks import (
    SingletonTask,
    SqlEffects,
    current_job,
    install,
    make_engine,
    runtime_for,
    singleton_task,
)
from tests.integration.apps.common import app_on_first_access, make_app, transport_options
from tests.integration.ledger import Ledger

__all__ = [
    "DEFAULT_LEASE_TTL",
    "DEFAULT_LOCK_SOCKET_TIMEOUT",
    "NotReady",
    "create_app",
    "create_schema",
    "effect_rows",
    "settings_from",
]

DEFAULT_LEASE_TTL = 2.0
DEFAULT_LOCK_SOCKET_TIMEOUT = 0.5
MAX_RETRIES = 2

metadata = sa.MetaData()
#: The SQL ledger's effect: one row per effect, committed with the job's DONE row.
effects_table = sa.Table(
    "it_delivery_effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(255), nullable=False, index=True),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("task_id", sa.String(255), nullable=False),
)


class NotReady(Exception):
    """Raised by ``singleton.autoretry`` until the test opens the job's gate."""


_ledger: Ledger | None = None
_ledger_pid: int | None = None


def ledger() -> Ledger:
    """This process's ledger client (made after fork, so pool children never share sockets)."""
    global _ledger, _ledger_pid
    if _ledger is None or _ledger_pid != os.getpid():
        url = os.environ.get("LEDGER_URL") or os.environ["BROKER_URL"]
        _ledger, _ledger_pid = Ledger.from_url(url), os.getpid()
    return _ledger


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    return float(raw) if raw else default


def settings_from(env: Mapping[str, str]) -> Settings:
    """jobfence settings for the test fleet: short leases, the broker's visibility timeout."""
    return Settings(
        lock_url=env.get("LOCK_URL") or env["BROKER_URL"],
        database_url=env.get("DATABASE_URL") or None,
        default_ttl=_seconds(env, "LEASE_TTL", DEFAULT_LEASE_TTL),
        socket_timeout=_seconds(env, "LOCK_SOCKET_TIMEOUT", DEFAULT_LOCK_SOCKET_TIMEOUT),
        visibility_timeout=float(transport_options(env)["visibility_timeout"]),
    )


def create_schema(database_url: str) -> None:
    """Create the fence, job and effect tables of the SQL ledger."""
    engine = make_engine(database_url)
    try:
        SqlEffects(engine).create_schema()
        metadata.create_all(engine, tables=[effects_table])
    finally:
        engine.dispose()


def effect_rows(engine: sa.Engine, job_id: str) -> list[dict[str, Any]]:
    """The SQL ledger's effect rows of ``job_id``, oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(effects_table)
            .where(effects_table.c.job_id == job_id)
            .order_by(effects_table.c.id)
        ).mappings()
        return [dict(r) for r in rows]


# -- task bodies ---------------------------------------------------------------------------


def _delivery(task: Task) -> dict[str, Any]:
    request = task.request
    info = request.delivery_info or {}
    job = current_job()
    return {
        "task_id": request.id,
        "worker": request.hostname,
        "redelivered": bool(info.get("redelivered")),
        "retries": request.retries,
        "key": job.key,
        "fence": job.fence,
    }


def _wait_at_gate(book: Ledger, job_id: str, timeout: float) -> bool:
    """Poll the job's gate until the test opens it; False if ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while not book.released(job_id):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def record(self: Task, job_id: str) -> int:
    """Start, have the effect, end: the smallest job there is."""
    book = ledger()
    meta = _delivery(self)
    book.start(job_id, **meta)
    count = book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return count


def gated(self: Task, job_id: str, timeout: float = 30.0, effect_first: bool = False) -> int | None:
    """Start, then wait until the test calls ``Ledger.release(job_id)`` (or ``timeout``)."""
    book = ledger()
    meta = _delivery(self)
    book.start(job_id, **meta)
    count = book.effect(job_id, phase="before", **meta) if effect_first else None
    if not _wait_at_gate(book, job_id, timeout):
        book.end(job_id, timed_out=True, **meta)
        return count
    if not effect_first:
        count = book.effect(job_id, phase="after", **meta)
    book.end(job_id, timed_out=False, **meta)
    return count


def _sql_effect(self: Task, job_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The job's effect in SQL: fenced on ``job:<id>``, committed with its DONE row."""
    job = current_job()
    effects = runtime_for(self.app).effects
    try:
        with effects.transaction(job, f"job:{job_id}") as tx:
            if not tx.done:
                tx.conn.execute(
                    effects_table.insert().values(
                        job_id=job_id, fence=job.fence, pid=os.getpid(), task_id=meta["task_id"]
                    )
                )
                tx.result = {"job": job_id, "fence": job.fence, "pid": os.getpid()}
    except StaleFence as exc:
        ledger().end(job_id, refused="StaleFence", last=exc.last, **meta)
        raise
    result: dict[str, Any] = tx.result
    return result


def sql_gated(
    self: Task, job_id: str, timeout: float = 30.0, effect_first: bool = False
) -> dict[str, Any] | None:
    """Like ``gated``, but the effect is a row in the SQL ledger written through the fence."""
    book = ledger()
    meta = _delivery(self)
    book.start(job_id, **meta)
    result = _sql_effect(self, job_id, meta) if effect_first else None
    if not _wait_at_gate(book, job_id, timeout):
        book.end(job_id, timed_out=True, **meta)
        return result
    if not effect_first:
        result = _sql_effect(self, job_id, meta)
    book.end(job_id, timed_out=False, **meta)
    return result


def flaky(self: Task, job_id: str) -> int:
    """``self.retry()`` at once until the test opens the gate, then have the effect."""
    book = ledger()
    meta = _delivery(self)
    book.start(job_id, **meta)
    if not book.released(job_id):
        book.end(job_id, failed=True, **meta)
        raise self.retry(countdown=0, exc=NotReady(f"{job_id} is not ready"))
    count = book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return count


def autoretry(self: Task, job_id: str) -> int:
    """Raise ``NotReady`` (retried by ``autoretry_for``) until the test opens the gate."""
    book = ledger()
    meta = _delivery(self)
    book.start(job_id, **meta)
    if not book.released(job_id):
        book.end(job_id, failed=True, **meta)
        raise NotReady(f"{job_id} is not ready")
    count = book.effect(job_id, **meta)
    book.end(job_id, **meta)
    return count


def _register(app: Celery) -> None:
    def singleton(name: str, body: Any, **options: Any) -> None:
        singleton_task(app=app, name=name, bind=True, shared=False, **options)(body)

    singleton("singleton.record", record)
    singleton("singleton.gated", gated)
    singleton("singleton.gated_wait", gated, on_conflict="wait", wait_timeout=30.0)
    singleton("singleton.gated_retry", gated, on_conflict="retry", max_retries=20)
    singleton("singleton.gated_raise", gated, on_conflict="raise")
    singleton("singleton.sql_gated", sql_gated)
    singleton("singleton.flaky", flaky, max_retries=MAX_RETRIES)
    singleton(
        "singleton.autoretry",
        autoretry,
        autoretry_for=(NotReady,),
        max_retries=MAX_RETRIES,
        default_retry_delay=0,
        retry_backoff=False,
        retry_jitter=False,
    )


def create_app(env: Mapping[str, str], name: str = "singleton_app") -> Celery:
    """The Celery app with its jobfence runtime and every ``singleton.*`` task registered."""
    app = make_app(name, env)
    install(app, settings_from(env))
    _register(app)
    return app


# -- outcomes ------------------------------------------------------------------------------


def _job_id(args: Any, kwargs: Any) -> str | None:
    if args:
        return str(args[0])
    value = (kwargs or {}).get("job_id")
    return None if value is None else str(value)


@signals.task_postrun.connect(weak=False)
def _record_outcome(
    task_id: str | None = None,
    task: Any = None,
    args: Any = None,
    kwargs: Any = None,
    retval: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    if not isinstance(task, SingletonTask) or not task.name.startswith("singleton."):
        return
    job_id = _job_id(args, kwargs)
    if job_id is None:
        return
    info: dict[str, Any] = {"task_id": task_id, "task": task.name, "state": state}
    info["retries"] = task.request.retries
    if state == "SUCCESS":
        info["value"] = retval
    else:
        info["error"] = type(retval).__name__
    ledger().outcome(job_id, **info)


__getattr__ = app_on_first_access(__name__, create_app)
