"""Advisory locks scoped to the caller's transaction, each grant fenced from the same database.

For short critical sections whose effect commits in that transaction (not for the job
lease: a session advisory lock outlives a partitioned client or is dropped behind a frozen
one's back, and carries no fence)::

    with engine.begin() as conn:
        with advisory.transaction_lock(conn, "stock:sku-1", timeout=2.0) as fence:
            ...  # read-modify-write; it commits with the transaction

PostgreSQL takes ``pg_advisory_xact_lock`` on a 64-bit hash of the key: the database
releases it at commit or rollback. MySQL/MariaDB's ``GET_LOCK`` is **session-scoped**: it
survives the commit, so it is released with ``RELEASE_LOCK`` right after the transaction
ends, on every path (commit, rollback, an error in the body, the connection's close).
Each grant advances a per-key row in ``jobfence_fences`` in the same transaction to
``max(last + 1, server clock in µs)``: the one fence space of every backend (DESIGN §4).

Isolation: PostgreSQL needs READ COMMITTED (a snapshot isolation takes its snapshot with
the lock statement, before the wait: refused). Under MySQL's REPEATABLE READ the snapshot
is fixed by the transaction's first plain read: take the lock before reading anything.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, event, text
from sqlalchemy.exc import DBAPIError

from jobfence.locks.errors import AcquireTimeout, LockError
from jobfence.locks.guards import fences
from jobfence.locks.sql import ensure_tables

__all__ = [
    "FENCE_RESOURCE_PREFIX",
    "advisory_id",
    "fence_resource",
    "lock_name",
    "transaction_lock",
    "try_transaction_lock",
]

FENCE_RESOURCE_PREFIX = "jobfence-advisory:"
MYSQL_NAME_PREFIX = "jf:"  # GET_LOCK names are server-wide: the hash includes the database
MYSQL_NAME_LENGTH = 64  # MySQL's limit (MariaDB allows 192)
PG_LOCK_NOT_AVAILABLE = "55P03"
FOREVER_S = 365 * 86400  # MariaDB answers NULL to a negative GET_LOCK timeout (MySQL: forever)

_PG_FENCE = text(
    "INSERT INTO jobfence_fences AS f (resource, fence) "
    "VALUES (:resource, (extract(epoch from clock_timestamp()) * 1000000)::bigint) "
    "ON CONFLICT (resource) DO UPDATE SET fence = greatest(f.fence + 1, excluded.fence) "
    "RETURNING fence"
)
_PG_WAIT = "pg_advisory_xact_lock(:id) IS NOT NULL"  # void: waits, then true
# The lock CTE is evaluated once, before the insert reads its row: the fence is taken
# under the lock, and ON CONFLICT updates the newest row version (READ COMMITTED).
_PG_LOCK_AND_FENCE = (
    "WITH l AS MATERIALIZED ("
    " SELECT current_setting('transaction_isolation') AS iso, {call} AS got"
    "), granted AS ("
    " INSERT INTO jobfence_fences AS f (resource, fence)"
    " SELECT :resource, (extract(epoch from clock_timestamp()) * 1000000)::bigint"
    " FROM l WHERE l.got AND l.iso = 'read committed'"
    " ON CONFLICT (resource) DO UPDATE SET fence = greatest(f.fence + 1, excluded.fence)"
    " RETURNING fence"
    ") SELECT l.iso, l.got, (SELECT fence FROM granted) FROM l"
)
# The clock expression again in the UPDATE part, neither VALUES(fence) (deprecated since
# MySQL 8.0.20) nor a row alias (`AS new`, MySQL 8.0.19+, a syntax error on MariaDB): one
# statement both accept without a warning. No RETURNING (MySQL has none): a locking read.
_MY_NOW_US = "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)"
_MY_FENCE = text(
    f"INSERT INTO jobfence_fences (resource, fence) VALUES (:resource, {_MY_NOW_US}) "
    f"ON DUPLICATE KEY UPDATE fence = GREATEST(fence + 1, {_MY_NOW_US})"
)
_MY_READ_FENCE = text("SELECT fence FROM jobfence_fences WHERE resource = :resource FOR UPDATE")


def _digest(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise LockError("key must be a non-empty string (the advisory lock's name)")
    return hashlib.sha256(key.encode()).digest()


def advisory_id(key: str) -> int:
    """PostgreSQL's lock id for `key`: the first 8 bytes of its SHA-256, signed (stable)."""
    return int.from_bytes(_digest(key)[:8], "big", signed=True)


def lock_name(key: str, database: str) -> str:
    """MySQL's GET_LOCK name for `key` in `database`: 64 characters, the key not readable."""
    digest = hashlib.sha256(f"{database}\0{key}".encode()).hexdigest()
    return (MYSQL_NAME_PREFIX + digest)[:MYSQL_NAME_LENGTH]


def fence_resource(key: str) -> str:
    """The `jobfence_fences` row that holds `key`'s last advisory fence (hashed key)."""
    return FENCE_RESOURCE_PREFIX + _digest(key).hex()


@contextmanager
def transaction_lock(conn: Connection, key: str, *, timeout: float | None = None) -> Iterator[int]:
    """Lock `key` until `conn`'s transaction ends; yield this grant's fence.

    Waits at most `timeout` seconds (None: as long as it takes), then raises
    AcquireTimeout; the caller's transaction stays usable. The fence strictly increases
    per key in hold order and is at least the server clock in µs.
    """
    if timeout is not None and (not math.isfinite(timeout) or timeout < 0):
        raise LockError(f"timeout must be a finite number of seconds >= 0 or None, got {timeout!r}")
    with _locked(conn, key, timeout) as fence:
        if fence is None:
            waited = FOREVER_S if timeout is None else timeout
            raise AcquireTimeout(f"advisory lock not acquired within {waited:g}s")
        yield fence


@contextmanager
def try_transaction_lock(conn: Connection, key: str) -> Iterator[int | None]:
    """Like `transaction_lock` without waiting: yield the fence, or None if another holds it."""
    with _locked(conn, key, 0.0) as fence:
        yield fence


@contextmanager
def _locked(conn: Connection, key: str, timeout: float | None) -> Iterator[int | None]:
    _digest(key)
    if not conn.in_transaction():
        raise LockError(
            "transaction_lock needs a connection in a transaction (`with engine.begin() as "
            "conn:`): the lock lasts until that transaction ends"
        )
    dialect = conn.dialect.name
    if dialect == "postgresql":
        yield _pg_lock(conn, key, timeout)
    elif dialect in ("mysql", "mariadb"):
        with _mysql_locked(conn, key, timeout) as fence:
            yield fence
    else:
        raise LockError(
            f"advisory transaction locks need PostgreSQL or MySQL/MariaDB, not {dialect}; "
            "use a lease (open_backend) with a fence guard instead"
        )


# --------------------------------------------------------------------------- PostgreSQL


def _pg_lock(conn: Connection, key: str, timeout: float | None) -> int | None:
    lock_id = advisory_id(key)
    ensure_tables(conn, [fences])
    if timeout is None or timeout == 0:
        # One round trip: the isolation check, the lock, then the fence (a refusal below
        # rolls the caller's transaction back, and the lock and fence with it).
        call = "pg_try_advisory_xact_lock(:id)" if timeout == 0 else _PG_WAIT
        isolation, got, fence = conn.execute(
            text(_PG_LOCK_AND_FENCE.format(call=call)),
            {"id": lock_id, "resource": fence_resource(key)},
        ).one()
        _refuse_snapshot(isolation)
        return None if not got else int(fence)
    setting = conn.execute(text("SELECT current_setting('transaction_isolation')"))
    _refuse_snapshot(setting.scalar_one())
    if not _pg_lock_within(conn, lock_id, timeout):
        return None
    return int(conn.execute(_PG_FENCE, {"resource": fence_resource(key)}).scalar_one())


def _refuse_snapshot(isolation: str) -> None:
    if isolation != "read committed":
        # The lock statement itself would take the snapshot, before the wait: reads inside
        # the lock would miss the previous holder's commit.
        raise LockError(
            f"advisory transaction locks need READ COMMITTED, this transaction is {isolation}: "
            "under a snapshot isolation the snapshot predates the lock; use "
            "engine.execution_options(isolation_level='READ COMMITTED')"
        )


def _pg_lock_within(conn: Connection, lock_id: int, timeout: float) -> bool:
    """Wait in the server's lock queue up to `timeout`; a timeout rolls back to a savepoint.

    lock_timeout aborts the transaction: the savepoint keeps the caller's usable, and its
    rollback also restores the caller's lock_timeout.
    """
    ms = max(1, math.ceil(timeout * 1000))
    savepoint = conn.begin_nested()
    try:
        old = conn.execute(
            text("SELECT current_setting('lock_timeout'), set_config('lock_timeout', :ms, true)"),
            {"ms": f"{ms}ms"},
        ).scalar_one()
        conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": lock_id})
        conn.execute(text("SELECT set_config('lock_timeout', :old, true)"), {"old": old})
    except DBAPIError as exc:
        savepoint.rollback()
        if getattr(exc.orig, "sqlstate", None) == PG_LOCK_NOT_AVAILABLE:
            return False
        raise
    savepoint.commit()  # the lock moves to the caller's transaction
    return True


# --------------------------------------------------------------------------- MySQL / MariaDB


@contextmanager
def _mysql_locked(conn: Connection, key: str, timeout: float | None) -> Iterator[int | None]:
    database = conn.engine.url.database or conn.execute(text("SELECT DATABASE()")).scalar_one()
    database = database or ""
    name = lock_name(key, database)
    wait = FOREVER_S if timeout is None else timeout
    got = conn.execute(text("SELECT GET_LOCK(:name, :wait)"), {"name": name, "wait": wait})
    status = got.scalar_one()
    if status is None:
        raise LockError("GET_LOCK failed on the server (killed or out of memory)")
    if not status:
        yield None
        return
    release = _release_after_transaction(conn, name)
    try:
        ensure_tables(conn, [fences])
        resource = fence_resource(key)
        conn.execute(_MY_FENCE, {"resource": resource})
        fence = int(conn.execute(_MY_READ_FENCE, {"resource": resource}).scalar_one())
        yield fence
    finally:
        # GET_LOCK outlives the transaction: release now if it already ended (or the body
        # failed and the caller's rollback will not reach us); otherwise at its end.
        if not conn.in_transaction():
            release()


# Connections with GET_LOCK names to release once their transaction ends. One listener pair
# per Connection (listeners cannot be removed while the event is being dispatched).
_pending: weakref.WeakKeyDictionary[Connection, list[str]] = weakref.WeakKeyDictionary()


def _release_after_transaction(conn: Connection, name: str) -> Callable[[], None]:
    """Arrange RELEASE_LOCK(name) right after `conn`'s transaction commits or rolls back.

    SQLAlchemy's commit/rollback events fire before the DBAPI call, so the listener ends
    the transaction itself and then releases: no other session can take the lock before
    this transaction's effect is committed. SQLAlchemy's own call after it is a no-op.
    """
    if conn not in _pending:
        _pending[conn] = []
        event.listen(conn, "commit", _on_commit)
        event.listen(conn, "rollback", _on_rollback)
    _pending[conn].append(name)
    return lambda: _release_pending(conn)


def _release_pending(conn: Connection) -> None:
    names = _pending.get(conn)
    if not names:
        return
    taken, names[:] = list(names), []
    if conn.closed or conn.invalidated:
        return  # the session is gone, and its locks with it
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    cur = dbapi.cursor()
    try:
        for name in reversed(taken):
            cur.execute("SELECT RELEASE_LOCK(%s)", (name,))
            cur.fetchall()
    finally:
        cur.close()


def _end_then_release(conn: Connection, end: Callable[[Any], None]) -> None:
    if not _pending.get(conn):
        return
    try:
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        end(dbapi)
    finally:
        _release_pending(conn)


def _on_commit(conn: Connection) -> None:
    _end_then_release(conn, lambda dbapi: dbapi.commit())


def _on_rollback(conn: Connection) -> None:
    _end_then_release(conn, lambda dbapi: dbapi.rollback())
