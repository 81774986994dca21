"""The PostgreSQL lock backend: a lease table on the server clock, fences in the common µs space."""

from __future__ import annotations

import fnmatch
import os
import random
import select
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Unpack

import psycopg
from psycopg import errors as pgerrors
from psycopg.conninfo import conninfo_to_dict

from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    LockBackend,
    LockInfo,
    poll_until_free,
)
from jobfence.locks.backends.common import FENCE_RETENTION, PrunedUrlOptions, url_options
from jobfence.locks.backends.postgres import connection
from jobfence.locks.backends.postgres.checks import PostgresChecks
from jobfence.locks.backends.postgres.connection import creators_wait, tables_exist
from jobfence.locks.backends.postgres.protocol import (
    begin_params,
    commit_params,
    extend_params,
    like_prefix,
    lock_info,
    parse_begin,
    parse_extend,
    wake_params,
)
from jobfence.locks.backends.postgres.records import PostgresRecords
from jobfence.locks.backends.postgres.semaphores import PostgresSemaphores
from jobfence.locks.backends.postgres.statements import (
    BEGIN,
    CHANNEL,
    COMMIT,
    CREATE_SEQUENCE,
    DDL,
    EXTEND,
    EXTEND_MANY,
    FENCE_SEQUENCE,
    FORCE_RELEASE,
    HELD,
    INSPECT,
    MARK_WAITING,
    RATE_TABLE,
    RATE_TAKE,
    RELEASE,
    RELEASE_GRANT,
    SCAN,
    TABLE,
)
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import OwnerMeta

PRUNE_INTERVAL = 600.0
POLL_FIRST = 0.002  # the poll's first step, doubled up to POLL_CAP
POLL_CAP = 0.05


class PostgresBackend(PostgresRecords, PostgresChecks, PostgresSemaphores, LockBackend):
    """Leases in one PostgreSQL table. Build with `from_url`; tables are made on first use."""

    name: ClassVar[str] = "postgres"
    fence_sequence: ClassVar[str] = FENCE_SEQUENCE
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=False, release_notify=True,
        semaphore=True, rate_limit=True,
    )

    def __init__(
        self,
        conninfo: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = FENCE_RETENTION,
        prune_interval: float = PRUNE_INTERVAL,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(clock=clock)
        self.prefix = prefix
        self.fence_retention_ms = max(1, int(fence_retention * 1000))
        self.prune_interval = prune_interval
        # The first pass comes a while after start: short-lived processes (a CLI) leave it
        # to the fleet, and a fleet started at once does not open a connection each for it.
        self._next_prune = clock.monotonic() + prune_interval * random.uniform(0.5, 1.0)
        self.socket_timeout = socket_timeout
        self.conninfo = conninfo
        where = conninfo_to_dict(conninfo)  # never the password
        self._shown = f"{where.get('host', '')}:{where.get('port', '')}/{where.get('dbname', '')}"
        self.fence_floor = 0
        self.statements = 0  # statements sent (one round trip each), for tests and benchmarks
        self._pid = os.getpid()
        self._idle: list[psycopg.Connection[Any]] = []
        self._ready = False
        self._max_block = max(0.01, 0.8 * socket_timeout)
        # Whether the server is reached through a pooler: learned at each connect (the same
        # URL always reaches it the same way); then no prepared statements and no LISTEN.
        self.pooled: bool | None = None

    @classmethod
    def from_url(cls, url: str, **options: Unpack[PrunedUrlOptions]) -> PostgresBackend:
        """`postgresql://`, `postgres://` or `postgresql+psycopg://` (libpq query options kept).

        A key's row (and its last fence) is pruned `fence_retention` seconds after its last
        use, once nothing in it is live; a later grant's fence is above it anyway (µs clock).
        """
        o = url_options(options)
        return cls(
            connection.conninfo_for(url, o.socket_timeout),
            prefix=o.prefix,
            socket_timeout=o.socket_timeout,
            fence_retention=o.fence_retention,
            prune_interval=options.get("prune_interval", PRUNE_INTERVAL),
            clock=o.clock,
        )

    # -- connections -------------------------------------------------------------
    def _connect(self) -> psycopg.Connection[Any]:
        conn, self.pooled = connection.connect(self.conninfo)
        return conn

    def _forked(self) -> None:
        if self._pid != os.getpid():
            connection.inherited.extend(self._idle)
            self._pid, self._idle = os.getpid(), []

    @contextmanager
    def _conn(self, what: str, key: str | None) -> Iterator[psycopg.Connection[Any]]:
        """A connection of this process for one statement; errors become BackendUnavailable."""
        self._forked()
        conn: psycopg.Connection[Any] | None = None
        try:
            conn = self._idle.pop()  # atomic: no two threads get the same one
        except IndexError:
            pass
        else:
            # Readable while idle: the server closed it (restart, idle timeout). Drop it now
            # rather than fail a statement the server never saw.
            try:
                stale = conn.closed or bool(select.select([conn.fileno()], [], [], 0)[0])
            except (OSError, ValueError, psycopg.Error):
                stale = True
            if stale:
                conn.close()
                conn = None
        try:
            if conn is None:
                conn = self._connect()
            yield conn
        except psycopg.Error as exc:
            if conn is not None and conn.broken:
                conn.close()
            raise BackendUnavailable(
                f"postgres {what} failed on {self._shown}", key=key, cause=exc
            ) from exc
        finally:
            if conn is not None and not conn.closed:
                self._idle.append(conn)

    def _run(self, what: str, key: str | None, sql: str, params: Any) -> list[tuple[Any, ...]]:
        """One statement, one round trip; creates the tables the first time they are missing."""
        for attempt in (0, 1):
            try:
                if not self._ready:
                    self.create_tables()
                with self._conn(what, key) as conn:
                    self.statements += 1
                    cur = conn.execute(sql, params, prepare=True)
                    return cur.fetchall() if cur.description else [(cur.rowcount,)]
            except BackendUnavailable as exc:
                # The tables vanished (a restore without them): make them and run it again;
                # the statement failed whole, so nothing ran twice.
                if attempt == 0 and isinstance(exc.cause, pgerrors.UndefinedTable):
                    self._ready = False
                    continue
                raise
        raise AssertionError("unreachable")

    def create_tables(self) -> None:
        """Create the lease table and the fence sequence where missing (safe to repeat)."""
        with self._conn("create tables", None) as conn:
            if not tables_exist(conn, (TABLE, RATE_TABLE, FENCE_SEQUENCE)):
                with conn.transaction():
                    # Serialise creators: two CREATE ... IF NOT EXISTS at once can collide.
                    creators_wait(conn, TABLE)
                    conn.execute(CREATE_SEQUENCE)
                    for stmt in DDL:
                        conn.execute(stmt)
        self._ready = True

    @staticmethod
    def ddl() -> list[str]:
        """The statements `create_tables` runs, for a DBA."""
        return [CREATE_SEQUENCE, *DDL]

    def server_time(self) -> float:
        """Now on the server's clock (`clock_timestamp()`: the clock expiry runs on)."""
        rows = self._run(
            "server time", None, "SELECT extract(epoch FROM clock_timestamp())::float8", None
        )
        return float(rows[0][0])

    def _ping(self) -> str:
        # Not through _run: a probe must not create the tables on first use.
        with self._conn("health", None) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return f"PostgreSQL {row[0] if row else '?'}"

    # -- one round trip each ----------------------------------------------------
    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        params = begin_params(self.prefix, key, owner, ttl_ms, meta, record, fingerprint,
                              self.fence_floor)  # fmt: skip
        got = parse_begin(self._run("begin", key, BEGIN, params)[0])
        if self.clock.monotonic() >= self._next_prune:
            self._prune_soon()
        if isinstance(got, int) and got > self.fence_floor:
            self.fence_floor = got
        return got

    def _take_rate(
        self, key: str, interval_us: float, burst: int, max_wait_us: float
    ) -> tuple[bool, float, float]:
        params = {
            "prefix": self.prefix, "key": key, "interval": interval_us,
            "tau": (burst - 1) * interval_us, "max_wait": min(max_wait_us, 1e300),
        }  # fmt: skip
        admitted, wait_us, now_us = self._run("rate take", key, RATE_TAKE, params)[0]
        return bool(admitted), float(wait_us), float(now_us)

    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        rows = self._run("extend", key, EXTEND, (ttl_ms, self.prefix, key, owner))
        return bool(rows[0][0])

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        rows = self._run("extend_many", None, EXTEND_MANY, extend_params(self.prefix, items))
        return parse_extend(items, rows)

    def _wake(self, what: str, key: str, sql: str, params: dict[str, Any]) -> bool:
        return bool(self._run(what, key, sql, wake_params(self.prefix, key, params))[0][0])

    def _release(self, key: str, owner: str) -> bool:
        return self._wake("release", key, RELEASE, {"owner": owner})

    def _commit(self, rec: CommitRecord) -> bool:
        return self._wake("commit", rec.key, COMMIT, commit_params(rec))

    def _inspect(self, key: str) -> LockInfo | None:
        rows = self._run("inspect", key, INSPECT, (self.prefix, key))
        return lock_info(key, rows[0]) if rows else None

    # -- admin and waiting --------------------------------------------------------
    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        rows = self._run("scan", None, SCAN, (self.prefix, like_prefix(match)))
        for key, *rest in rows:
            if fnmatch.fnmatchcase(key, match):
                yield lock_info(key, tuple(rest))

    def force_release(self, key: str) -> bool:
        return self._wake("force_release", key, FORCE_RELEASE, {})

    def release_grant(self, key: str, fence: int) -> bool:
        """Remove `key`'s lock if still held under `fence`: checked in the one statement."""
        return self._wake("release_grant", key, RELEASE_GRANT, {"fence": fence})

    def wait_for_release(self, key: str, timeout: float) -> None:
        """Block until `key` is released (LISTEN/NOTIFY) or `timeout` passes.

        The waiting connection listens only while it waits (LISTEN, mark the lease as
        waited on and see it still held, wait, UNLISTEN), so a process needs no second
        connection, and a release after the mark is never missed. Behind a pooler (see
        `behind_pooler`) it polls the lease instead: LISTEN is session state.
        """
        timeout = min(timeout, self._max_block)
        if timeout < 0.001:
            return
        if not self._ready:
            self.create_tables()
        if self.pooled:
            self._poll_for_release(key, timeout)
            return
        payload = f"{self.prefix}\n{key}"
        with self._conn("wait", key) as conn:
            conn.execute(f"LISTEN {CHANNEL}")
            try:
                self.statements += 2
                if conn.execute(MARK_WAITING, (self.prefix, key), prepare=True).rowcount:
                    for note in conn.notifies(timeout=timeout):
                        if note.payload == payload:
                            break
            finally:
                conn.execute(f"UNLISTEN {CHANNEL}")
                self.statements += 1

    def _poll_for_release(self, key: str, timeout: float) -> None:
        """Behind a pooler: read the lease with doubling, jittered steps until it is free or
        `timeout` passes (a LISTEN would stay on whichever server session ran it)."""
        poll_until_free(
            self.clock, timeout, lambda: bool(self._run("wait", key, HELD, (self.prefix, key))),
            POLL_FIRST, POLL_CAP,
        )  # fmt: skip

    def close(self) -> None:
        if self._pid != os.getpid():
            self._forked()
            return
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
