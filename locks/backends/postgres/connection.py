"""Reaching PostgreSQL: the lock URL as libpq options, a pooler in between, forks' connections."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobfence.locks import registry

SCHEMES = registry.entry("postgres").schemes  # the registry is the one list
DEFAULT_PORT = 5432

# Where the connection's own backend pid (its cancel key) is not the pid of the server
# session that runs its statements, a pooler sits between: PgBouncer, Odyssey, PgCat,
# Supavisor and RDS Proxy hand each client a cancel key of their own.
SERVER_PID = "SELECT pg_backend_pid()"

# PgBouncer (and most poolers) refuse the startup `options` this backend sends unless told
# to ignore them; say so, with the fix, rather than a bare connection error.
_OPTIONS_REFUSED = "unsupported startup parameter"
OPTIONS_FIX = (
    "a pooler between jobfence and PostgreSQL refuses the startup options: add "
    "`ignore_startup_parameters = options` to pgbouncer.ini (and set the timeouts on the "
    "role: docs/how-to/pgbouncer.md#the-poolers-settings)"
)

# Connections inherited through fork, set aside in the child and never closed there: a
# close() would send libpq's goodbye on the socket the parent still uses.
inherited: list[Any] = []


def conninfo_for(url: str, socket_timeout: float) -> str:
    """The libpq connection string for a lock URL: `postgresql://`, `postgres://` or
    `postgresql+psycopg://`, its query options kept, the session's bounds added."""
    scheme, rest = url.split("://", 1)
    if scheme.lower() not in SCHEMES:
        raise ValueError(f"not a PostgreSQL URL: {scheme}://")
    base = "postgresql://" + rest
    ms = max(1, int(socket_timeout * 1000))
    params = conninfo_to_dict(base)
    # Keepalives and tcp_user_timeout make a silent network fail the call instead of
    # hanging it for hours.
    return make_conninfo(
        base,
        connect_timeout=max(1, int(socket_timeout + 0.999)),
        tcp_user_timeout=ms,
        keepalives=1,
        keepalives_idle=max(1, int(socket_timeout)),
        keepalives_interval=1,
        keepalives_count=2,
        application_name=str(params.get("application_name") or "jobfence"),
        options=session_options(str(params.get("options", "") or ""), ms),
    )


def session_options(given: str, ms: int) -> str:
    """The startup `options` (the URL's `given` ones first) every lock session runs with.

    Server-side bounds (a stuck statement ends within the socket timeout, `ms`); READ
    COMMITTED whatever the server's default: the upserts wait for a racing writer and then
    see its row, where REPEATABLE READ would fail them. Lease statements commit without
    waiting for the WAL flush (half the latency): a crash may forget the last grants, whose
    holders then lose the lease at their next heartbeat, and the next grant's fence is still
    above theirs (server µs clock). Job records are flushed (statements.COMMIT).
    """
    options = given + (
        f" -c statement_timeout={ms} -c lock_timeout={ms}"
        " -c synchronous_commit=off -c default_transaction_isolation=read\\ committed"
        " -c idle_in_transaction_session_timeout=" + str(max(ms, 10000))
    )
    return options.strip()


def connect(conninfo: str) -> tuple[psycopg.Connection[Any], bool]:
    """A new autocommit connection, and whether a pooler sits between (then it never
    prepares a statement); a pooler refusing the startup options is told how to fix."""
    try:
        conn = psycopg.connect(conninfo, autocommit=True)
    except psycopg.OperationalError as exc:
        if options_refused(exc):
            raise psycopg.OperationalError(f"{OPTIONS_FIX}: {exc}") from exc
        raise
    try:
        pooled = behind_pooler(conn)
    except BaseException:
        conn.close()
        raise
    if pooled:
        without_session_state(conn)
    return conn, pooled


def behind_pooler(conn: psycopg.Connection[Any]) -> bool:
    """Whether `conn` reaches PostgreSQL through a pooler (one round trip, at connect).

    Through a transaction pooler each transaction may run on another server session, so
    nothing may outlive one: no prepared statements (another client's `_pg3_0` is there, or
    ours is not), no LISTEN. A session pooler is taken for one too: that costs only speed.
    """
    row = conn.execute(SERVER_PID, prepare=False).fetchone()
    return row is None or int(row[0]) != conn.info.backend_pid


def without_session_state(conn: psycopg.Connection[Any]) -> None:
    """No statement of `conn` is ever prepared (psycopg prepares after 5 runs, or at once
    with prepare=True): the state a transaction pooler would mix up between clients."""
    conn.prepare_threshold = None


def options_refused(exc: BaseException) -> bool:
    """Whether `exc` is a pooler refusing the startup options (see OPTIONS_FIX)."""
    return isinstance(exc, psycopg.OperationalError) and _OPTIONS_REFUSED in str(exc)


def tables_exist(conn: psycopg.Connection[Any], names: tuple[str, ...]) -> bool:
    """Whether every named relation is on the search path: one read, no lock, so a fleet
    starting at once does not queue its sessions behind one another's DDL."""
    probe = " AND ".join(["to_regclass(%s) IS NOT NULL"] * len(names))
    row = conn.execute(f"SELECT {probe}", names).fetchone()
    return bool(row and row[0])


def creators_wait(conn: psycopg.Connection[Any], name: str) -> None:
    """Take the creators' lock for this transaction; waiting behind another session's DDL is
    expected here, so the session's short statement and lock bounds give way to a minute."""
    conn.execute("SET LOCAL statement_timeout = '60s'")
    conn.execute("SET LOCAL lock_timeout = '60s'")
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (name,))
