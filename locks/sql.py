"""jobfence's SQL tables: created on first use (race-safe), their DDL; engines safe across fork."""

from __future__ import annotations

import os
import random
import threading
import time
import weakref
from collections.abc import Sequence

from sqlalchemy import Connection, Engine, Table, inspect
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.schema import CreateIndex, CreateTable, DDLElement

from jobfence.config.errors import JobfenceError

__all__ = [
    "SchemaError",
    "create_tables",
    "ddl",
    "dispose_after_fork",
    "ensure_tables",
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
