"""The MySQL/MariaDB lock backend: a lease table on server time, a durable fence counter row."""

from __future__ import annotations

import fnmatch
import random
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Unpack

import pymysql  # type: ignore[import-untyped]  # PyMySQL ships no type hints

# Bound from sys.modules["pymysql.err"], not through `pymysql.err` (see connection.py).
from pymysql.err import Error as PyMySQLError  # type: ignore[import-untyped]
from pymysql.err import MySQLError  # type: ignore[import-untyped]

from jobfence.locks.backend import (
    Busy,
    Capabilities,
    JobRecord,
    LockBackend,
    LockInfo,
    Security,
    poll_until_free,
)
from jobfence.locks.backends.common import UrlOptions, url_options
from jobfence.locks.backends.mysql.checks import MySQLChecks
from jobfence.locks.backends.mysql.connection import (
    Pool,
    connect_hint,
    discard,
    open_session,
    parse_url,
)
from jobfence.locks.backends.mysql.records import PURGE_BATCH, MySQLRecords, job_record_of
from jobfence.locks.backends.mysql.semaphores import MySQLSemaphores
from jobfence.locks.backends.mysql.statements import extend_many, statements
from jobfence.locks.backends.mysql.tables import (
    LOCK_DDL,
    RATE_DDL,
    filled,
    key_hash,
    lock_tables,
    quote_name,
)
from jobfence.locks.backends.mysql.tls import TLS_FILES, security_of, tls_context
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import OwnerMeta

RETRY_ERRORS = {1213, 1205}  # deadlock, lock wait timeout: the transaction was rolled back
NO_SUCH_TABLE = 1146  # someone dropped our tables: make them again
ATTEMPTS = 5
POLL_FIRST = 0.001  # wait_for_release: first poll step, doubled up to POLL_CAP
POLL_CAP = 0.010  # a waiter costs at most ~100 primary-key reads a second


class MySQLBackend(MySQLRecords, MySQLChecks, MySQLSemaphores, LockBackend):
    """Locks in a MySQL 8 / MariaDB 10.5+ table. Build with `from_url` or `from_settings`.

    Expiry runs on the server clock (`NOW(6)`, sessions at UTC and READ COMMITTED); each
    call is one round trip (a multi-statement transaction where it needs several).

    One SQL text for both servers (statements.py), isolation set by SET SESSION TRANSACTION
    (MySQL 8 removed tx_isolation). MySQL 8's default caching_sha2_password needs the
    `cryptography` package on plain TCP (the `mysql` extra brings it), or TLS (`ssl_ca` in
    the URL: verifies chain and host name).
    """

    name: ClassVar[str] = "mysql"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=False, release_notify=False,
        semaphore=True, rate_limit=True,
    )

    def __init__(
        self,
        *,
        connect_args: dict[str, Any],
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(clock=clock)
        self.prefix = prefix
        self.socket_timeout = socket_timeout
        self.tables = lock_tables(prefix)
        self.rate_table = quote_name(f"{prefix}_lock_rates")
        args = dict(connect_args)
        self._security = security_of(args)
        ctx = tls_context(args)
        if ctx is not None:
            for name in (*TLS_FILES, "ssl_verify_cert", "ssl_verify_identity"):
                args.pop(name, None)
            args["ssl"] = ctx
        self._tls = ctx is not None
        self._connect_args = args
        self._pool = Pool(self._open)
        self._ready = False
        self._ready_lock = threading.Lock()
        self._next_purge = 0.0
        # The highest fence this client was granted: the floor of its next grant, as on Redis.
        self.fence_floor = 0
        self._sql = statements(self.tables, self.rate_table)

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_url(cls, url: str, **options: Unpack[UrlOptions]) -> MySQLBackend:
        """A fence retention is accepted and unused: the fence counter is kept."""
        o = url_options(options)
        return cls(connect_args=parse_url(url), prefix=o.prefix, socket_timeout=o.socket_timeout,
                   clock=o.clock)  # fmt: skip

    def security(self) -> Security:
        """TLS and authentication as the URL asked for them (see `tls_options`)."""
        return self._security

    def _open(self) -> pymysql.connections.Connection[Any]:
        return open_session(self._connect_args, self.socket_timeout, self._tls)

    # -- running statements ---------------------------------------------------------
    def _run(self, sql: str, params: Any, key: str | None) -> list[Any]:
        """Run `sql` (one or more statements) in one round trip; per statement its rows
        (a tuple of tuples) or, for a statement without rows, its affected-row count.

        A deadlock or lock-wait timeout rolled the transaction back: retried (bounded,
        with jitter). Any other error closes the connection and raises BackendUnavailable.
        """
        self._ensure_tables(key)
        for attempt in range(ATTEMPTS):
            conn = self._connection(key)
            try:
                out = self._execute(conn, sql, params)
            except MySQLError as exc:
                code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
                if code in RETRY_ERRORS or code == NO_SUCH_TABLE:
                    if self._rollback(conn):
                        self._pool.put(conn)
                    if code == NO_SUCH_TABLE and attempt == 0:
                        self._ready = False
                        self._ensure_tables(key)
                        continue
                    if code in RETRY_ERRORS and attempt + 1 < ATTEMPTS:
                        time.sleep(random.uniform(0, min(0.05, 0.002 * 2**attempt)))
                        continue
                else:
                    discard(conn)
                raise BackendUnavailable(f"mysql call failed: {exc}", key=key, cause=exc) from exc
            except BaseException:
                discard(conn)  # interrupted mid-reply: the connection's state is unknown
                raise
            self._pool.put(conn)
            return out
        raise AssertionError("unreachable")

    def _connection(self, key: str | None) -> pymysql.connections.Connection[Any]:
        try:
            return self._pool.get()
        except MySQLError as exc:
            args = self._connect_args
            hint = connect_hint(exc, args.get("host", ""), args.get("user"))
            raise BackendUnavailable(
                f"cannot connect to the MySQL lock server: {hint or exc}", key=key, cause=exc
            ) from exc

    @staticmethod
    def _execute(conn: pymysql.connections.Connection[Any], sql: str, params: Any) -> list[Any]:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            out: list[Any] = []
            while True:
                out.append(list(cur.fetchall()) if cur.description else cur.rowcount)
                if not cur.nextset():
                    return out

    @staticmethod
    def _rollback(conn: pymysql.connections.Connection[Any]) -> bool:
        try:
            conn.rollback()
            return True
        except PyMySQLError:
            discard(conn)
            return False

    def _ensure_tables(self, key: str | None) -> None:
        if self._ready:
            return
        with self._ready_lock:
            if self._ready:
                return
            conn = self._connection(key)
            try:
                with conn.cursor() as cur:
                    for stmt in self.ddl():
                        for attempt in range(ATTEMPTS):
                            try:
                                cur.execute(stmt)
                                break
                            except MySQLError as exc:
                                # 1050: a racing creator made it between our check and ours.
                                if exc.args[0] not in (1050, *RETRY_ERRORS) or attempt == 4:
                                    raise
            except MySQLError as exc:
                discard(conn)
                raise BackendUnavailable(
                    f"could not create jobfence's lock tables ({exc}); grant CREATE on the "
                    "database or create them with `jobfence migrate`",
                    key=key,
                    cause=exc,
                ) from exc
            self._pool.put(conn)
            self._ready = True

    def create_tables(self) -> None:
        """Create the lock tables where missing (safe to repeat; first use does it too)."""
        self._ready = False
        self._ensure_tables(None)

    def ddl(self) -> list[str]:
        """The statements `create_tables` runs, for a DBA (names follow the prefix)."""
        return [*filled(LOCK_DDL, self.tables), *filled(RATE_DDL, {"rates": self.rate_table})]

    def server_time(self) -> float:
        """Now on the server's clock (`NOW(6)` at UTC: the clock expiry runs on)."""
        rows = self._run("SELECT UNIX_TIMESTAMP(NOW(6))", None, None)
        return float(rows[0][0][0])

    def _ping(self) -> str:
        # Not through _run: a probe must not create the tables on first use.
        conn = self._connection(None)
        try:
            rows = self._execute(conn, "SELECT VERSION()", None)
        except BaseException:
            discard(conn)
            raise
        self._pool.put(conn)
        return f"MySQL/MariaDB {rows[0][0][0]}"

    # -- one round trip each ----------------------------------------------------------
    def _take_rate(
        self, key: str, interval_us: float, burst: int, max_wait_us: float
    ) -> tuple[bool, float, float]:
        params = {
            "h": key_hash(key), "iv": interval_us, "tau": (burst - 1) * interval_us,
            "mw": min(max_wait_us, 1e300),
        }  # fmt: skip
        sets = self._run(self._sql["rate_take"], params, key)
        admitted, wait_us, now_us = sets[2][0]
        return bool(admitted), float(wait_us), float(now_us)

    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        params = {
            "h": key_hash(key),
            "k": key,
            "o": owner,
            "ttl": ttl_ms * 1000,
            "tid": meta.task_id,
            "tn": meta.task_name,
            "host": meta.host,
            "pid": meta.pid,
            "ps": meta.process_start,
            "fp": fingerprint,
            "floor": self.fence_floor,
        }
        sets = self._run(self._sql["begin_job" if record else "begin"], params, key)
        rows = [s for s in sets if isinstance(s, list)]
        if record and rows[1]:
            return job_record_of(rows[1][0])
        if not rows[0]:
            raise BackendUnavailable("mysql begin: the lock row vanished", key=key)
        is_mine, fence, left_us, task_id, fp = rows[0][0]
        if is_mine:
            granted = int(fence)
            if granted > self.fence_floor:
                self.fence_floor = granted
            return granted
        return Busy(ttl_left=max(0, int(left_us)) / 1e6, task_id=task_id, fingerprint=fp)

    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        return bool(self._run(self._sql["extend"], (ttl_ms * 1000, key_hash(key), owner), key)[0])

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        return extend_many(self._run, self.tables["locks"], items, by_key=True)

    def _release(self, key: str, owner: str) -> bool:
        return bool(self._run(self._sql["release"], (key_hash(key), owner), key)[0])

    def _inspect(self, key: str) -> LockInfo | None:
        rows = self._run(
            self._sql["inspect"] + " WHERE key_hash = %s AND expires_at > NOW(6)",
            (key_hash(key),),
            key,
        )[0]
        return lock_info(rows[0]) if rows else None

    # -- admin and waiting ----------------------------------------------------------
    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        """Held locks matching the glob, in pages by key hash (plain reads: no row locks)."""
        literal = match
        for i, c in enumerate(match):
            if c in "*?[":
                literal = match[:i]
                break
        like = literal.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"
        after = ""
        while True:
            rows = self._run(
                self._sql["inspect"]
                + " WHERE key_hash > %s AND lock_key LIKE %s ESCAPE '!' AND expires_at > NOW(6)"
                f" ORDER BY key_hash LIMIT {PURGE_BATCH}",
                (after, like),
                None,
            )[0]
            for row in rows:
                if fnmatch.fnmatchcase(row[9], match):
                    yield lock_info(row)
            if len(rows) < PURGE_BATCH:
                return
            after = key_hash(rows[-1][9])

    def force_release(self, key: str) -> bool:
        return bool(self._run(self._sql["force_release"], (key_hash(key),), key)[0])

    def release_grant(self, key: str, fence: int) -> bool:
        """Remove `key`'s lock if still held under `fence`: checked in the one statement."""
        return bool(self._run(self._sql["release_grant"], (key_hash(key), fence), key)[0])

    def wait_for_release(self, key: str, timeout: float) -> None:
        """Poll the lock row with doubling, jittered steps (1 ms up to 10 ms) until it is
        free or `timeout` passes. MySQL has no notification a waiter could block on."""
        h = key_hash(key)
        poll_until_free(
            self.clock, timeout, lambda: bool(self._run(self._sql["held"], (h,), key)[0]),
            POLL_FIRST, POLL_CAP,
        )  # fmt: skip

    def close(self) -> None:
        self._pool.close()


def lock_info(row: tuple[Any, ...]) -> LockInfo:
    """A held lock from its `inspect` row."""
    fence, left_us, host, pid, task_id, task_name, acq_us, hb_us, started, key = row
    return LockInfo(
        key=key,
        fence=int(fence),
        ttl_left=max(0, int(left_us)) / 1e6,
        host=host,
        pid=int(pid),
        task_id=task_id,
        task_name=task_name,
        acquired_at=int(acq_us) / 1e6,
        last_heartbeat=int(hb_us) / 1e6,
        process_start=started,
    )
