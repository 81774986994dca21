"""jobfence's SQL tables: created on first use (race-safe), their DDL; engines safe across fork;
transactions in which a lost connection never reads as the body's failure."""

from __future__ import annotations

import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, Table, inspect
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.schema import CreateIndex, CreateTable, DDLElement

from jobfence.config.errors import JobfenceError

__all__ = [
    "MYSQL_LINK_ERRORS",
    "PG_SESSION_ENDED",
    "SchemaError",
    "connection_lost",
    "create_tables",
    "ddl",
    "dispose_after_fork",
    "ensure_tables",
    "link_lost",
    "transaction_on_own_connection",
]

CREATE_ATTEMPTS = 5


class SchemaError(JobfenceError):
    """jobfence's tables are missing and could not be created (privileges, a broken server)."""


# Engines whose tables were seen to exist, with those table names: checked once per engine
# per process. A forked child inherits the entries, which stay true (the tables exist).
_ready: weakref.WeakKeyDictionary[Engine, frozenset[str]] = weakref.WeakKeyDictionary()
_forked: weakref.WeakSet[Engine] = weakref.WeakSet()
_lock = threading.Lock()


def dispose_after_fork(engine: Engine) -> Engine:
    """Give `engine` a fresh connection pool in every child forked from now on.

    A pooled connection inherited through fork shares its socket with the parent and the
    siblings: interleaved messages end in "server closed the connection unexpectedly".
    `dispose(close=False)` drops the child's references without closing the parent's
    sockets. Every engine jobfence builds or writes through is registered; returns `engine`.
    An in-memory SQLite database lives in its connection: the child keeps its copy.
    """
    if not _in_memory(engine):
        _forked.add(engine)
    return engine


def _in_memory(engine: Engine) -> bool:
    url = engine.url
    return url.get_backend_name() == "sqlite" and (
        url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"
    )


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for engine in list(_forked):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_after_fork_in_child)


def ensure_tables(bind: Engine | Connection, tables: Sequence[Table]) -> None:
    """Create whichever of `tables` is missing; after the first success, a dict lookup.

    With an `Engine`, or a `Connection` on a server database, the tables are created in a
    transaction of their own (MySQL's DDL would commit the caller's; PostgreSQL's would
    hold the caller's locks). SQLite inside the caller's transaction creates them there:
    that transaction already holds the database's write lock.
    """
    engine = bind.engine
    names = frozenset(t.name for t in tables)
    if names <= _ready.get(engine, frozenset()):
        return
    dispose_after_fork(engine)
    with _lock:
        if names <= _ready.get(engine, frozenset()):
            return
        in_caller_tx = isinstance(bind, Connection) and bind.in_transaction()
        if in_caller_tx and bind.dialect.name == "sqlite":
            assert isinstance(bind, Connection)
            created = _create_missing(bind, tables)  # IF NOT EXISTS: no race to lose
            if created:
                return  # not cached: the caller may still roll our tables back
        else:
            _create_with_retries(engine, tables)
        _ready[engine] = _ready.get(engine, frozenset()) | names


def create_tables(engine: Engine, tables: Sequence[Table]) -> list[str]:
    """Create the missing `tables` now (for `jobfence migrate`); the names it created."""
    created = _create_with_retries(engine, tables)
    dispose_after_fork(engine)
    with _lock:
        _ready[engine] = _ready.get(engine, frozenset()) | {t.name for t in tables}
    return created


def ddl(dialect: Dialect, tables: Sequence[Table]) -> list[str]:
    """The CREATE statements of `tables` for `dialect`, each safe to run again."""
    texts = (str(stmt.compile(dialect=dialect)) for stmt in _statements(tables))
    return ["\n".join(line.rstrip() for line in text.strip().splitlines()) for text in texts]


def _statements(tables: Sequence[Table]) -> list[DDLElement]:
    out: list[DDLElement] = []
    for table in tables:
        out.append(CreateTable(table, if_not_exists=True))
        out.extend(CreateIndex(index, if_not_exists=True) for index in table.indexes)
    return out


def _missing(conn: Connection, tables: Sequence[Table]) -> list[Table]:
    found = inspect(conn)
    return [t for t in tables if not found.has_table(t.name, schema=t.schema)]


def _create_missing(conn: Connection, tables: Sequence[Table]) -> list[str]:
    missing = _missing(conn, tables)
    for stmt in _statements(missing):
        conn.execute(stmt)
    return [t.name for t in missing]


def _create_with_retries(engine: Engine, tables: Sequence[Table]) -> list[str]:
    """Check, then create what is missing; a creator racing us makes us check again.

    Two PostgreSQL sessions running CREATE TABLE IF NOT EXISTS at once can still collide
    (a unique violation on pg_type); MariaDB may report that the table exists. Either way
    the other session made the table: look again rather than fail.
    """
    created: list[str] = []
    for attempt in range(CREATE_ATTEMPTS):
        try:
            with engine.begin() as conn:
                created += _create_missing(conn, tables)
            return created
        except DBAPIError as exc:
            with engine.connect() as conn:
                still = _missing(conn, tables)
            if not still:
                return created
            if attempt == CREATE_ATTEMPTS - 1:
                names = ", ".join(t.name for t in still)
                raise SchemaError(
                    f"jobfence's table(s) {names} are missing and could not be created on "
                    f"{engine.dialect.name} ({type(exc.orig).__name__}). Create them with "
                    "`jobfence migrate` as a role that may create tables, or print the DDL "
                    "with `jobfence migrate --sql` for your DBA"
                ) from exc
            time.sleep(random.uniform(0, 0.05 * 2**attempt))  # full jitter
    return created


# -- a lost connection ------------------------------------------------------------------------

#: MySQL/MariaDB client errors that mean the link is gone: server gone away, lost during a
#: query, commands out of sync, lost at the handshake, a broken pipe, a session killed.
MYSQL_LINK_ERRORS = frozenset({2006, 2013, 2014, 2045, 2055, 4031})

#: PostgreSQL SQLSTATEs that end the session: connection exceptions (class 08), the server
#: shutting down or refusing (57P01-57P03), a transaction's idle or total timeout (25P03-04).
PG_SESSION_ENDED = frozenset({"57P01", "57P02", "57P03", "25P03", "25P04"})

#: Told of a lost connection: `settle(exc, at_commit)` raises CommitOutcomeUnknown, or (only
#: at COMMIT) returns when the transaction is found to have landed.
Settle = Callable[[Exception, bool], None]


def link_lost(exc: BaseException, dbapi_connection: object = None) -> bool:
    """Whether `exc`, raised inside a transaction, says its database connection is gone (a
    restart, a failover, a killed session, a dropped link), so that transaction did not
    commit. A user's own error on a live connection (an integrity error, bad SQL) is not.

    Told by SQLAlchemy's verdict (`connection_invalidated`), a MySQL client code, a
    PostgreSQL SQLSTATE that ends the session, or the driver's connection itself (psycopg's
    `broken`/`closed`, PyMySQL's and mysqlclient's `open`).
    """
    if not isinstance(exc, Exception):
        return False  # a cancel or an exit, not a database's answer
    if _down(dbapi_connection):
        return True
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DBAPIError) and err.connection_invalidated:
            return True
        if type(err).__name__ in ("OperationalError", "InterfaceError") and err.args:
            code = err.args[0]
            if type(code) is int and code in MYSQL_LINK_ERRORS:
                return True
        state = getattr(err, "sqlstate", None) or getattr(err, "pgcode", None)  # psycopg 3, 2
        if isinstance(state, str) and (state.startswith("08") or state in PG_SESSION_ENDED):
            return True
        err = err.__cause__ or err.__context__
    return False


def connection_lost(exc: BaseException, conn: Connection) -> bool:
    """`link_lost` for an SQLAlchemy connection: invalidated, or its driver's link is down."""
    if not isinstance(exc, Exception):
        return False
    if conn.invalidated:
        return True
    raw: object = None
    if not conn.closed:
        try:
            raw = conn.connection.dbapi_connection
        except DBAPIError:
            raw = None
    return link_lost(exc, raw)


def _down(raw: object) -> bool:
    if raw is None:
        return False
    if getattr(raw, "broken", False) is True:  # psycopg 3
        return True
    closed = getattr(raw, "closed", 0)  # psycopg: True, or 1/2 in psycopg2
    if not callable(closed) and closed:
        return True
    opened = getattr(raw, "open", None)  # PyMySQL, mysqlclient
    return opened is not None and not callable(opened) and not opened


@contextmanager
def transaction_on_own_connection(
    engine: Engine, tables: Sequence[Table], settle: Settle
) -> Iterator[Connection]:
    """A transaction on a connection of its own, in which a lost connection never reads as
    the body failing: lost anywhere (connecting, any statement, the COMMIT), `settle` is
    told. Any other error rolls the transaction back and propagates as it is."""
    try:
        ensure_tables(engine, tables)
        conn = engine.connect()
    except (OperationalError, InterfaceError) as exc:  # unreachable: nothing began
        settle(exc, False)
        raise
    with conn:
        trans = conn.begin()
        try:
            yield conn
        except BaseException as exc:
            lost = connection_lost(exc, conn)
            try:
                trans.rollback()
            except DBAPIError:
                if not lost:
                    raise
            if lost:
                assert isinstance(exc, Exception)
                settle(exc, False)
            raise
        try:
            trans.commit()
        except DBAPIError as exc:  # the link died at COMMIT (a timeout's end is InternalError)
            if not isinstance(exc, (OperationalError, InterfaceError)) and not connection_lost(
                exc, conn
            ):
                raise
            settle(exc, True)
