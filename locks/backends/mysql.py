"""The MySQL/MariaDB lock backend: a lease table on server time, a durable fence counter row."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import random
import select
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlsplit

import pymysql  # type: ignore[import-untyped]  # PyMySQL ships no type hints
from pymysql.constants import CLIENT  # type: ignore[import-untyped]

# The error classes PyMySQL raises, bound from sys.modules["pymysql.err"]: once Django (or
# anyone) runs pymysql.install_as_MySQLdb() and imports MySQLdb.constants, a second copy
# of pymysql/err.py is loaded as MySQLdb.err and replaces the `pymysql.err` attribute, so
# `except pymysql.err.MySQLError` would stop matching what connections raise.
from pymysql.err import Error as PyMySQLError  # type: ignore[import-untyped]
from pymysql.err import MySQLError  # type: ignore[import-untyped]
from pymysql.err import OperationalError as PyMySQLOperationalError  # type: ignore[import-untyped]

from jobfence.config.findings import Finding, LockTarget
from jobfence.locks import registry
from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    LockBackend,
    LockInfo,
    Security,
    poll_until_free,
)
from jobfence.locks.backends.common import flag_value, server_findings
from jobfence.locks.backends.mysql_semaphore import MySQLSemaphores, extend_many
from jobfence.locks.backends.mysql_semaphore import key_hash as key_hash
from jobfence.locks.backends.probe import foreign_sql_refusal
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable, LockError
from jobfence.locks.lease import OwnerMeta

SCHEMES = registry.entry("mysql").schemes  # the registry is the one list
DEFAULT_PORT = 3306
RETRY_ERRORS = {1213, 1205}  # deadlock, lock wait timeout: the transaction was rolled back
NO_SUCH_TABLE = 1146  # someone dropped our tables: make them again
ATTEMPTS = 5
POLL_FIRST = 0.001  # wait_for_release: first poll step, doubled up to POLL_CAP
POLL_CAP = 0.010  # a waiter costs at most ~100 primary-key reads a second
PURGE_EVERY = 60.0  # seconds between sweeps of expired rows (one statement per table)
PURGE_BATCH = 500
# PyMySQL's spellings, and MySQL's own `ssl_mode` (as the mysql client and Connector/J).
URL_OPTIONS = (
    "unix_socket", "ssl_ca", "ssl_cert", "ssl_key", "ssl_verify_cert", "ssl_verify_identity",
    "ssl_mode",
)  # fmt: skip
SSL_MODES = ("VERIFY_IDENTITY", "VERIFY_CA", "REQUIRED", "DISABLED")
TLS_FILES = ("ssl_ca", "ssl_cert", "ssl_key")

# Server microseconds since the epoch: the session runs at time_zone '+00:00', so NOW(6) is
# UTC and this is plain arithmetic (no time zone table, no DST gap).
NOW_US = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', NOW(6))"


def _quote(name: str) -> str:
    if len(name) > 64:
        raise LockError(
            f"table name {name!r} is longer than MySQL's 64 characters; "
            "set JOBFENCE_KEY_PREFIX to a shorter prefix"
        )
    return "`" + name.replace("`", "``") + "`"


def _ddl(locks: str, jobs: str, fence: str, marks: str) -> list[str]:
    key = "key_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL"
    text = "TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
    return [
        f"""CREATE TABLE IF NOT EXISTS {locks} (
  {key} PRIMARY KEY,
  lock_key VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  owner CHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
  fence BIGINT UNSIGNED NOT NULL,
  expires_at DATETIME(6) NOT NULL,
  acquired_at DATETIME(6) NOT NULL,
  heartbeat_at DATETIME(6) NOT NULL,
  task_id {text}, task_name {text}, host {text}, pid BIGINT NOT NULL,
  process_start {text}, fingerprint {text},
  KEY (expires_at)
) ENGINE=InnoDB""",
        f"""CREATE TABLE IF NOT EXISTS {jobs} (
  {key} PRIMARY KEY,
  lock_key VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  state VARCHAR(8) CHARACTER SET ascii NOT NULL,
  fingerprint {text}, result LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  fence BIGINT UNSIGNED NOT NULL,
  finished_at DATETIME(6) NOT NULL,
  expires_at DATETIME(6) NOT NULL,
  KEY (expires_at)
) ENGINE=InnoDB""",
        # One counter row, advanced inside each acquire transaction: a committed InnoDB
        # write, so a crash never hands a value out twice (AUTO_INCREMENT repeats on MySQL
        # 5.7, a bare NEXTVAL of a MariaDB SEQUENCE repeats after kill -9).
        f"""CREATE TABLE IF NOT EXISTS {fence} (
  id TINYINT UNSIGNED NOT NULL PRIMARY KEY,
  v BIGINT UNSIGNED NOT NULL
) ENGINE=InnoDB""",
        f"INSERT IGNORE INTO {fence} (id, v) VALUES (1, {NOW_US})",
        f"""CREATE TABLE IF NOT EXISTS {marks} (
  {key},
  kind CHAR(1) CHARACTER SET ascii NOT NULL,
  value {text},
  n BIGINT NOT NULL,
  expires_at DATETIME(6) NOT NULL,
  PRIMARY KEY (key_hash, kind),
  KEY (expires_at)
) ENGINE=InnoDB""",
    ]


def _rate_ddl(rates: str) -> list[str]:
    """The rate limiters' table (locks/ratelimit.py): GCRA state `tat` and the answer of the
    last step beside it, in µs on the server clock."""
    return [
        f"""CREATE TABLE IF NOT EXISTS {rates} (
  key_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
  tat DOUBLE NOT NULL,
  admitted TINYINT NOT NULL,
  wait_us DOUBLE NOT NULL,
  now_us DOUBLE NOT NULL
) ENGINE=InnoDB"""
    ]


class _Pool:
    """Idle connections of one process, one thread at a time each; forgotten after a fork.

    A forked child must not touch its parent's sockets (a COM_QUIT or a half-read reply
    there breaks the parent's session), so after a fork the idle list starts empty and the
    inherited connections are dropped without a word to the server.
    """

    def __init__(self, connect: Any) -> None:
        self.connect = connect
        self.pid = os.getpid()
        self.idle: list[pymysql.connections.Connection[Any]] = []

    def get(self) -> pymysql.connections.Connection[Any]:
        if self.pid != os.getpid():
            self.pid, self.idle = os.getpid(), []
        while True:
            try:
                conn = self.idle.pop()
            except IndexError:
                fresh: pymysql.connections.Connection[Any] = self.connect()
                return fresh
            # An idle connection with something to read was closed by the server (restart,
            # wait_timeout, KILL): its goodbye or EOF is waiting. Drop it before sending,
            # rather than fail a call the server never saw.
            sock = getattr(conn, "_sock", None)
            try:
                stale = sock is None or bool(select.select([sock], [], [], 0)[0])
            except (OSError, ValueError):
                stale = True
            if not stale:
                return conn
            _discard(conn)

    def put(self, conn: pymysql.connections.Connection[Any]) -> None:
        if self.pid == os.getpid():
            self.idle.append(conn)

    def close(self) -> None:
        idle, self.idle = self.idle, []
        if self.pid == os.getpid():
            for conn in idle:
                with contextlib.suppress(PyMySQLError):
                    conn.close()


class TlsNotOffered(PyMySQLOperationalError):  # type: ignore[misc]  # untyped base
    """TLS was asked for and the server's greeting offers none: refused before the login."""


class TlsFirstConnection(pymysql.connections.Connection):  # type: ignore[misc]  # untyped base
    """A PyMySQL connection that refuses, before sending the login, a server offering no
    TLS when its arguments ask for TLS.

    PyMySQL 1.1.x carried on in clear text there and answered the server's switch to
    `mysql_clear_password` with the password; 1.2.0+ refuses too. Checked here so that no
    PyMySQL version and no man in the middle stripping the SSL flag can get the login.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._tls_asked = asks_tls(kwargs)
        super().__init__(**kwargs)

    def _request_authentication(self) -> None:
        # `client_flag` has CLIENT.SSL whenever PyMySQL itself was asked for TLS (every
        # version); PREFERRED (no TLS option) has not, and may fall back as the URL allows.
        asked = self._tls_asked or bool(self.client_flag & CLIENT.SSL)
        if asked and not self.server_capabilities & CLIENT.SSL:
            raise TlsNotOffered(
                2026,
                f"the MySQL server at {self.host}:{self.port} offers no TLS (its greeting "
                "lacks the SSL capability) though the URL asks for it (ssl_mode, ssl_ca, "
                "ssl_cert or ssl_verify_*): refused before sending the login, no password "
                "was sent",
            )
        super()._request_authentication()


def asks_tls(kwargs: dict[str, Any]) -> bool:
    """Whether PyMySQL arguments ask for TLS (as every PyMySQL reads them)."""
    if kwargs.get("ssl_disabled"):
        return False
    names = ("ssl", "ssl_ca", "ssl_cert", "ssl_key", "ssl_verify_cert", "ssl_verify_identity")
    return any(kwargs.get(name) for name in names)


class MySQLBackend(MySQLSemaphores, LockBackend):
    """Locks in a MySQL 8 / MariaDB 10.5+ table. Build with `from_url` or `from_settings`.

    Expiry runs on the server clock (`NOW(6)`, sessions at UTC and READ COMMITTED); each
    call is one round trip (a multi-statement transaction where it needs several).

    One SQL text for both servers (tests/test_mysql_backend.py checks every statement
    sent): no RETURNING (MariaDB only; answers come from a SELECT in the same transaction),
    no VALUES(col) in upserts (deprecated on MySQL 8.0.20+) and no row alias (`AS new`, a
    syntax error on MariaDB), no sequences (MariaDB only; a bare NEXTVAL repeats after a
    crash), isolation set by SET SESSION TRANSACTION (MySQL 8 removed tx_isolation).
    MySQL 8's default caching_sha2_password needs the `cryptography` package on plain TCP
    (the `mysql` extra brings it), or TLS (`ssl_ca` in the URL: verifies chain and host name).
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
        # Named apart from the SQL effects' `{prefix}_jobs` and the guards' `{prefix}_fences`,
        # which may live in the same database.
        names = {"locks": "leases", "jobs": "records", "fence": "fence", "marks": "marks"}
        self.tables = {t: _quote(f"{prefix}_lock_{n}") for t, n in names.items()}
        self.rate_table = _quote(f"{prefix}_lock_rates")
        args = dict(connect_args)
        self._security = _security_of(args)
        ctx = tls_context(args)
        if ctx is not None:
            for name in (*TLS_FILES, "ssl_verify_cert", "ssl_verify_identity"):
                args.pop(name, None)
            args["ssl"] = ctx
        self._tls = ctx is not None
        self._connect_args = args
        self._pool = _Pool(self._open)
        self._ready = False
        self._ready_lock = threading.Lock()
        self._next_purge = 0.0
        # The highest fence this client was granted: the floor of its next grant, as on Redis.
        self.fence_floor = 0
        self._sql = self._statements()

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float | None = None,  # accepted for open_backend; the counter is kept
        clock: Clock = SYSTEM_CLOCK,
    ) -> MySQLBackend:
        del fence_retention
        return cls(
            connect_args=parse_url(url), prefix=prefix, socket_timeout=socket_timeout, clock=clock
        )

    def security(self) -> Security:
        """TLS and authentication as the URL asked for them (see `tls_options`)."""
        return self._security

    def _open(self) -> pymysql.connections.Connection[Any]:
        timeout = self.socket_timeout
        conn = TlsFirstConnection(
            **self._connect_args,
            charset="utf8mb4",
            autocommit=True,
            connect_timeout=max(1, int(timeout + 0.999)),
            read_timeout=timeout,
            write_timeout=timeout,
            # MULTI_STATEMENTS: a transaction in one round trip. FOUND_ROWS: an UPDATE
            # reports the rows it matched, not only those it changed.
            client_flag=CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS,
        )
        if self._tls and not isinstance(getattr(conn, "_sock", None), ssl.SSLSocket):
            # Unreachable (TlsFirstConnection refused before the login): a last guard.
            _discard(conn)
            raise PyMySQLOperationalError(2026, "SSL is required but the server doesn't support it")
        with conn.cursor() as cur:
            # READ COMMITTED: no gap locks (two acquires of absent keys deadlock under
            # REPEATABLE READ), and each statement sees what committed before it.
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            cur.execute(
                "SET time_zone = '+00:00', innodb_lock_wait_timeout = %s",
                (max(1, int(timeout / 2)),),
            )
        return conn

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
                    _discard(conn)
                raise BackendUnavailable(f"mysql call failed: {exc}", key=key, cause=exc) from exc
            except BaseException:
                _discard(conn)  # interrupted mid-reply: the connection's state is unknown
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
            _discard(conn)
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
                    for stmt in [*_ddl(*self.tables.values()), *_rate_ddl(self.rate_table)]:
                        for attempt in range(ATTEMPTS):
                            try:
                                cur.execute(stmt)
                                break
                            except MySQLError as exc:
                                # 1050: a racing creator made it between our check and ours.
                                if exc.args[0] not in (1050, *RETRY_ERRORS) or attempt == 4:
                                    raise
            except MySQLError as exc:
                _discard(conn)
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
        return [*_ddl(*self.tables.values()), *_rate_ddl(self.rate_table)]

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
            _discard(conn)
            raise
        self._pool.put(conn)
        return f"MySQL/MariaDB {rows[0][0][0]}"

    # Where an acquire+release pair's ~1.2-1.5 ms goes on loopback here (MariaDB 10.11,
    # profiled): two durable commits (a redo-log flush each, ~170 µs on this disk), the six
    # statements of `begin` run server-side, and PyMySQL decoding seven replies (~400 µs
    # of client CPU). One round trip per call is the floor. Reading a grant from the
    # counter UPDATE's OK packet instead of a SELECT saved ~50 µs of client CPU, no wall
    # time we could measure, and cost refused acquires a second round trip: not taken.
    def _rate_statement(self) -> str:
        """One GCRA step: the upsert locks the row, assigns left to right (each column sees
        those updated before it) and leaves its answer in the row for the SELECT."""
        rt = self.rate_table
        start = "GREATEST(tat, now_us)"
        return ";".join(
            [
                "START TRANSACTION",
                f"INSERT INTO {rt} (key_hash, tat, admitted, wait_us, now_us) VALUES (%(h)s,"
                f" IF(%(mw)s >= 0, {NOW_US} + %(iv)s, 0), %(mw)s >= 0, 0, {NOW_US})"
                f" ON DUPLICATE KEY UPDATE now_us = {NOW_US},"
                f" wait_us = GREATEST({start} - %(tau)s - now_us, 0),"
                " admitted = (%(mw)s >= 0 AND wait_us <= %(mw)s),"
                f" tat = IF(admitted, {start} + %(iv)s, tat)",
                f"SELECT admitted, wait_us, now_us FROM {rt} WHERE key_hash = %(h)s",
                "COMMIT",
            ]
        )

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

    def _statements(self) -> dict[str, str]:
        lk, jb, fc, mk = (self.tables[t] for t in ("locks", "jobs", "fence", "marks"))
        free = "expires_at <= NOW(6)"

        def take(col: str, value: str) -> str:
            return f"{col} = IF({free}, {value}, {col})"

        # The upsert names its new values as parameters again in the UPDATE part instead of
        # VALUES(col) (deprecated on MySQL 8.0.20+) or a row alias (`AS new`, rejected by
        # MariaDB): both servers accept this form without a warning. MySQL assigns left to
        # right with the values already updated, so expires_at, which the guard reads,
        # comes last.
        upsert = (
            f"INSERT INTO {lk} (key_hash, lock_key, owner, fence, expires_at, acquired_at,"
            " heartbeat_at, task_id, task_name, host, pid, process_start, fingerprint)"
            " VALUES (%(h)s, %(k)s, %(o)s, 0, NOW(6) + INTERVAL %(ttl)s MICROSECOND, NOW(6),"
            " NOW(6), %(tid)s, %(tn)s, %(host)s, %(pid)s, %(ps)s, %(fp)s)"
            " ON DUPLICATE KEY UPDATE "
            + ", ".join(
                [
                    take("lock_key", "%(k)s"),
                    take("owner", "%(o)s"),
                    take("fence", "0"),
                    take("acquired_at", "NOW(6)"),
                    take("heartbeat_at", "NOW(6)"),
                    take("task_id", "%(tid)s"),
                    take("task_name", "%(tn)s"),
                    take("host", "%(host)s"),
                    take("pid", "%(pid)s"),
                    take("process_start", "%(ps)s"),
                    take("fingerprint", "%(fp)s"),
                    take("expires_at", "NOW(6) + INTERVAL %(ttl)s MICROSECOND"),
                ]
            )
        )
        mine = f"SELECT 1 FROM {lk} WHERE key_hash = %(h)s AND owner = %(o)s"
        done = (
            f"SELECT 1 FROM {jb} WHERE key_hash = %(h)s AND state = 'DONE'"
            " AND expires_at > NOW(6)"
        )
        # The DONE check runs after the upsert locked the lock row: a commit that finished
        # before it is seen, and one still running holds the row, so ours waited for it.
        undo_if_done = (
            f"DELETE FROM {lk} WHERE key_hash = %(h)s AND owner = %(o)s AND EXISTS ({done})"
        )
        # Fences: the counter's next value, at least the server's clock in µs (the one
        # fence space of every backend; it also keeps a database restored from a backup
        # above the fences it issued since) and above this client's floor.
        advance = (
            f"UPDATE {fc} SET v = LAST_INSERT_ID(GREATEST(v + 1, %(floor)s + 1, {NOW_US}))"
            f" WHERE id = 1 AND EXISTS ({mine})"
        )
        stamp = f"UPDATE {lk} SET fence = LAST_INSERT_ID() WHERE key_hash = %(h)s AND owner = %(o)s"
        clear_failed = f"DELETE FROM {jb} WHERE key_hash = %(h)s AND EXISTS ({mine})"
        answer = (
            f"SELECT owner = %(o)s, fence, TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at),"
            f" task_id, fingerprint FROM {lk} WHERE key_hash = %(h)s"
        )
        record = (
            f"SELECT state, fingerprint, result, fence,"
            f" TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', finished_at)"
            f" FROM {jb} WHERE key_hash = %(h)s AND state = 'DONE' AND expires_at > NOW(6)"
        )
        live = "expires_at > NOW(6)"
        return {
            "rate_take": self._rate_statement(),
            "begin": ";".join(["START TRANSACTION", upsert, advance, stamp, answer, "COMMIT"]),
            "begin_job": ";".join(
                [
                    "START TRANSACTION",
                    upsert,
                    undo_if_done,
                    advance,
                    stamp,
                    clear_failed,
                    answer,
                    record,
                    "COMMIT",
                ]
            ),
            "extend": (
                f"UPDATE {lk} SET heartbeat_at = NOW(6), expires_at = NOW(6) + INTERVAL %s"
                f" MICROSECOND WHERE key_hash = %s AND owner = %s AND {live}"
            ),
            "release": f"DELETE FROM {lk} WHERE key_hash = %s AND owner = %s AND {live}",
            "commit": ";".join(
                [
                    "START TRANSACTION",
                    f"DELETE FROM {lk} WHERE key_hash = %(h)s AND owner = %(o)s AND {live}",
                    "SET @jf_ok = ROW_COUNT()",
                    f"INSERT INTO {jb} (key_hash, lock_key, state, fingerprint, result, fence,"
                    " finished_at, expires_at) SELECT %(h)s, %(k)s, %(st)s, %(fp)s, %(res)s,"
                    " %(fence)s, NOW(6), NOW(6) + INTERVAL %(rttl)s MICROSECOND FROM DUAL"
                    " WHERE @jf_ok = 1 ON DUPLICATE KEY UPDATE lock_key = %(k)s,"
                    " state = %(st)s, fingerprint = %(fp)s, result = %(res)s, fence = %(fence)s,"
                    " finished_at = NOW(6), expires_at = NOW(6) + INTERVAL %(rttl)s MICROSECOND",
                    "COMMIT",
                    "SELECT @jf_ok",
                ]
            ),
            "inspect": (
                "SELECT fence, TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at), host, pid,"
                " task_id, task_name,"
                " TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', acquired_at),"
                " TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', heartbeat_at),"
                f" process_start, lock_key FROM {lk}"
            ),
            "held": f"SELECT 1 FROM {lk} WHERE key_hash = %s AND {live}",
            "job_record": (
                "SELECT state, fingerprint, result, fence,"
                " TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', finished_at)"
                f" FROM {jb} WHERE key_hash = %s AND state IN ('DONE', 'FAILED') AND {live}"
            ),
            "forget": f"DELETE FROM {jb} WHERE key_hash = %s AND {live}",
            "force_release": f"DELETE FROM {lk} WHERE key_hash = %s AND {live}",
            "release_grant": f"DELETE FROM {lk} WHERE key_hash = %s AND fence = %s AND {live}",
            # A live marker of another task id stays; the value is assigned before
            # expires_at, so both read the old expiry.
            "claim_publish": ";".join(
                [
                    "START TRANSACTION",
                    f"INSERT INTO {mk} (key_hash, kind, value, n, expires_at) VALUES (%(h)s,"
                    " 'q', %(v)s, 0, NOW(6) + INTERVAL %(ttl)s MICROSECOND)"
                    " ON DUPLICATE KEY UPDATE"
                    " value = IF(expires_at <= NOW(6) OR value = %(v)s, %(v)s, value),"
                    " expires_at = IF(value = %(v)s, NOW(6) + INTERVAL %(ttl)s MICROSECOND,"
                    " expires_at)",
                    f"SELECT value FROM {mk} WHERE key_hash = %(h)s AND kind = 'q'",
                    "COMMIT",
                ]
            ),
            "clear_publish": f"DELETE FROM {mk} WHERE key_hash = %s AND kind = 'q'",
            # n (unused by claims) first records whether a live other value keeps the claim:
            # the later assignments read it. A removed claim is '' expiring now.
            "swap_publish": ";".join(
                [
                    "START TRANSACTION",
                    f"INSERT INTO {mk} (key_hash, kind, value, n, expires_at) VALUES (%(h)s,"
                    " 'q', %(v)s, 0, NOW(6) + INTERVAL %(ttl)s MICROSECOND)"
                    " ON DUPLICATE KEY UPDATE"
                    " n = IF(expires_at > NOW(6) AND value <> %(e)s AND value <> %(v)s, 1, 0),"
                    " value = IF(n = 1, value, %(v)s),"
                    " expires_at = IF(n = 1, expires_at, NOW(6) + INTERVAL %(ttl)s MICROSECOND)",
                    f"SELECT IF(n = 1, value, NULL) FROM {mk}"
                    " WHERE key_hash = %(h)s AND kind = 'q'",
                    "COMMIT",
                ]
            ),
            "count_delivery": ";".join(
                [
                    "START TRANSACTION",
                    f"INSERT INTO {mk} (key_hash, kind, value, n, expires_at) VALUES (%(h)s,"
                    " 'd', '', 1, NOW(6) + INTERVAL %(ttl)s MICROSECOND)"
                    " ON DUPLICATE KEY UPDATE n = IF(expires_at > NOW(6), n + 1, 1),"
                    " expires_at = NOW(6) + INTERVAL %(ttl)s MICROSECOND",
                    f"SELECT n FROM {mk} WHERE key_hash = %(h)s AND kind = 'd'",
                    "COMMIT",
                ]
            ),
        }

    # -- one round trip each ----------------------------------------------------------
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
            return _job_record(rows[1][0])
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

    def _commit(self, rec: CommitRecord) -> bool:
        key, owner, fence, state, result, fingerprint, result_ttl_ms = rec
        params = {
            "h": key_hash(key),
            "k": key,
            "o": owner,
            "st": state,
            "fp": fingerprint,
            "res": result,
            "fence": fence,
            "rttl": result_ttl_ms * 1000,
        }
        sets = self._run(self._sql["commit"], params, key)
        ok = bool(int(sets[-1][0][0] or 0))
        self._maybe_purge()
        return ok

    def _inspect(self, key: str) -> LockInfo | None:
        rows = self._run(
            self._sql["inspect"] + " WHERE key_hash = %s AND expires_at > NOW(6)",
            (key_hash(key),),
            key,
        )[0]
        return _info(rows[0]) if rows else None

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
                    yield _info(row)
            if len(rows) < PURGE_BATCH:
                return
            after = key_hash(rows[-1][9])

    def job_record(self, key: str) -> JobRecord | None:
        rows = self._run(self._sql["job_record"], (key_hash(key),), key)[0]
        return _job_record(rows[0]) if rows else None

    def forget(self, key: str) -> bool:
        return bool(self._run(self._sql["forget"], (key_hash(key),), key)[0])

    def force_release(self, key: str) -> bool:
        return bool(self._run(self._sql["force_release"], (key_hash(key),), key)[0])

    def release_grant(self, key: str, fence: int) -> bool:
        """Remove `key`'s lock if still held under `fence`: checked in the one statement."""
        return bool(self._run(self._sql["release_grant"], (key_hash(key), fence), key)[0])

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        params = {"h": key_hash(key), "v": task_id, "ttl": max(1000, int(ttl * 1e6))}
        sets = self._run(self._sql["claim_publish"], params, key)
        held = next(s for s in sets if isinstance(s, list))
        value = held[0][0] if held else None
        return value if value and value != task_id else None

    def clear_publish(self, key: str) -> None:
        self._run(self._sql["clear_publish"], (key_hash(key),), key)

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        ttl_us = ttl_ms * 1000 if new is not None else 0
        params = {"h": key_hash(key), "e": expect, "v": new or "", "ttl": ttl_us}
        sets = self._run(self._sql["swap_publish"], params, key)
        rows = next(s for s in sets if isinstance(s, list))
        kept = rows[0][0] if rows else None
        return str(kept) if kept else None

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        params = {"h": key_hash(key), "ttl": window_ms * 1000}
        sets = self._run(self._sql["count_delivery"], params, key)
        rows = next(s for s in sets if isinstance(s, list))
        return int(rows[0][0])

    def wait_for_release(self, key: str, timeout: float) -> None:
        """Poll the lock row with doubling, jittered steps (1 ms up to 10 ms) until it is
        free or `timeout` passes. MySQL has no notification a waiter could block on."""
        h = key_hash(key)
        poll_until_free(
            self.clock, timeout, lambda: bool(self._run(self._sql["held"], (h,), key)[0]),
            POLL_FIRST, POLL_CAP,
        )  # fmt: skip

    def purge(self) -> int:
        """Delete rows that expired a minute ago or more (locks, job records, markers, idle
        rate limiters).

        Expired rows are dead already (every read filters on expiry); this only keeps the
        tables small. Runs from `commit` at most once a minute per client; best effort.
        """
        total = 0
        for table in ("locks", "jobs", "marks"):
            sets = self._run(
                f"DELETE FROM {self.tables[table]} WHERE expires_at < NOW(6) - INTERVAL 1 MINUTE"
                f" LIMIT {PURGE_BATCH}",
                (),
                None,
            )
            total += int(sets[0])
        # A limiter whose next turn is past is idle: its row means what no row means.
        sets = self._run(
            f"DELETE FROM {self.rate_table} WHERE tat < {NOW_US} - 60000000 LIMIT {PURGE_BATCH}",
            (),
            None,
        )
        return total + int(sets[0])

    def _maybe_purge(self) -> None:
        now = time.monotonic()
        if now < self._next_purge:
            return
        self._next_purge = now + PURGE_EVERY
        with contextlib.suppress(BackendUnavailable):  # a sweep can wait for the next minute
            self.purge()

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        def foreign() -> Finding | None:
            return foreign_sql_refusal(target, "MySQL/MariaDB", DEFAULT_PORT)

        return server_findings(target, self.server_problems, foreign)

    def server_problems(self) -> list[tuple[str, str]]:
        """What about the server breaks this backend, as (problem, fix) pairs; for start-up.

        A login or TLS set-up the server refuses is a problem too (no wait would help);
        raises BackendUnavailable if the server does not answer.
        """
        try:
            rows = self._run(
                "SELECT @@version, @@log_bin, @@binlog_format, @@read_only, @@innodb_read_only",
                (),
                None,
            )[0]
        except BackendUnavailable as exc:
            args = self._connect_args
            cause = exc.cause if isinstance(exc.cause, MySQLError) else None
            hint = cause and connect_hint(cause, args.get("host", ""), args.get("user"))
            if not hint:
                raise
            return [(f"cannot connect to the MySQL lock server ({cause})", hint)]
        version, log_bin, binlog_format, read_only, innodb_read_only = rows[0]
        return server_problems(
            version=str(version),
            log_bin=bool(int(log_bin)),
            binlog_format=str(binlog_format),
            read_only=bool(int(read_only)) or bool(int(innodb_read_only)),
        )

    def close(self) -> None:
        self._pool.close()


def server_problems(
    *, version: str, log_bin: bool, binlog_format: str, read_only: bool
) -> list[tuple[str, str]]:
    """The server settings under which no grant can be written, with their fixes."""
    out: list[tuple[str, str]] = []
    if log_bin and binlog_format.upper() == "STATEMENT":
        out.append(
            (
                f"the MySQL server ({version}) logs binlog_format=STATEMENT, under which InnoDB "
                "refuses every write made at READ COMMITTED (error 1665), which the lock "
                "table needs (REPEATABLE READ deadlocks acquires of absent keys on gap locks)",
                "set binlog_format=ROW (MySQL 8's default) or MIXED (MariaDB's) on the server",
            )
        )
    if read_only:
        out.append(
            (
                f"the MySQL server ({version}) is read-only (a replica?): no lock can be taken",
                "point the lock URL at the primary",
            )
        )
    return out


def _info(row: tuple[Any, ...]) -> LockInfo:
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


def _discard(conn: pymysql.connections.Connection[Any]) -> None:
    """Drop a connection in an unknown state: close its socket without a goodbye."""
    with contextlib.suppress(Exception):  # already broken
        conn._force_close()  # the public close() says goodbye over the socket first


def parse_url(url: str) -> dict[str, Any]:
    """PyMySQL connect arguments from mysql://user:password@host:port/database?options.

    TLS options come out normalised (`tls_options`): asked for at all, TLS verifies the
    server's certificate and host name unless an option turns that off."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in SCHEMES:
        raise LockError(f"not a MySQL URL: scheme {parts.scheme!r}; use mysql:// or mariadb://")
    database = unquote(parts.path.lstrip("/"))
    if not database or "/" in database:
        raise LockError(
            "the MySQL lock URL names no database: use mysql://user:password@host:3306/dbname"
        )
    args: dict[str, Any] = {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or DEFAULT_PORT,
        "database": database,
    }
    if parts.username:
        args["user"] = unquote(parts.username)
    if parts.password:
        args["password"] = unquote(parts.password)
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in URL_OPTIONS:
            raise LockError(
                f"unknown option {name!r} in the MySQL lock URL; known: {', '.join(URL_OPTIONS)}"
            )
        options[name] = value
    if "unix_socket" in options:
        args["unix_socket"] = options.pop("unix_socket")
    args.update(tls_options(options))
    return args


def _job_record(row: Sequence[Any]) -> JobRecord:
    """A job record from its row: (state, fingerprint, result, fence, finished µs)."""
    state, fp, result, fence, finished_us = row
    return JobRecord(
        state=state,
        fingerprint=fp,
        result=result,
        fence=int(fence),
        finished_at=int(finished_us) / 1e6,
    )


def _flag(name: str, value: str, where: str = "the MySQL lock URL") -> bool:
    if (flag := flag_value(value)) is not None:
        return flag
    raise LockError(f"option {name}={value!r} in {where} is not true or false")


def tls_options(
    options: dict[str, str], where: str = "the MySQL lock URL"
) -> dict[str, Any]:
    """PyMySQL's TLS arguments, every one explicit, from the URL's TLS options.

    Any of `ssl_ca`, `ssl_cert`, `ssl_key`, `ssl_verify_cert=true`, `ssl_verify_identity=true`
    or `ssl_mode` (but DISABLED) asks for TLS, and TLS means VERIFY_IDENTITY: the chain
    (against `ssl_ca`, else the system's CAs) and the host name. Less is a downgrade spelled
    out: `ssl_verify_identity=false` / `ssl_mode=VERIFY_CA` (chain only), `ssl_verify_cert=false`
    / `ssl_mode=REQUIRED` (encryption only). No option: no TLS asked for.
    """
    files = {name: options[name] for name in TLS_FILES if options.get(name)}
    for name in TLS_FILES:
        if name in options and not options[name]:
            raise LockError(f"option {name}= in {where} is empty: give a file path")
    cert = _flag("ssl_verify_cert", options["ssl_verify_cert"], where) \
        if "ssl_verify_cert" in options else None  # fmt: skip
    identity = _flag("ssl_verify_identity", options["ssl_verify_identity"], where) \
        if "ssl_verify_identity" in options else None  # fmt: skip
    if "ssl_mode" in options:
        mode = options["ssl_mode"].strip().upper().replace("-", "_")
        if mode not in SSL_MODES:
            raise LockError(
                f"ssl_mode={options['ssl_mode']!r} in {where} is not one of "
                f"{', '.join(SSL_MODES)}; use ssl_mode=VERIFY_IDENTITY (PREFERRED, which may "
                "fall back to plain text, is not offered)"
            )
        if cert is not None or identity is not None:
            raise LockError(
                f"{where} gives both ssl_mode and ssl_verify_cert/ssl_verify_identity; "
                "spell the TLS mode once, e.g. ssl_mode=VERIFY_IDENTITY"
            )
        if mode == "DISABLED":
            if files:
                raise LockError(
                    f"{where} gives ssl_mode=DISABLED with {', '.join(files)}; "
                    "drop one: TLS files with TLS disabled are never read"
                )
            return {"ssl_disabled": True}
        cert, identity = mode != "REQUIRED", mode == "VERIFY_IDENTITY"
    elif not files and not cert and not identity:
        return {}  # no TLS asked for (ssl_verify_cert=false alone turns nothing on)
    if identity and cert is False:
        raise LockError(
            f"{where} gives ssl_verify_identity=true with ssl_verify_cert=false: a host "
            "name is checked only on a verified certificate; drop ssl_verify_cert=false"
        )
    if "ssl_key" in files and "ssl_cert" not in files:
        raise LockError(
            f"{where} gives ssl_key without ssl_cert: add ssl_cert=/path/client.pem"
        )
    cert = cert is not False
    identity = cert if identity is None else identity
    return {**files, "ssl_verify_cert": cert, "ssl_verify_identity": identity}


def tls_context(
    args: dict[str, Any], where: str = "the MySQL lock URL"
) -> ssl.SSLContext | None:
    """The SSLContext for `parse_url`'s TLS arguments (None: no TLS asked for).

    Built here rather than by PyMySQL, which checks no host name for `ssl_ca` alone nor
    without a CA file, and (before 1.1.1) no certificate at all for `ssl_ca` alone."""
    if not _tls_asked(args):
        return None
    try:
        ctx = ssl.create_default_context(cafile=args.get("ssl_ca"))
    except (OSError, ssl.SSLError) as exc:
        raise LockError(
            f"ssl_ca={args.get('ssl_ca')!r} in {where} cannot be loaded ({exc}); "
            "give a readable PEM file of the CA that signed the server's certificate"
        ) from exc
    # As PyMySQL does: MySQL's auto-generated certificates fail Python 3.13's strict checks.
    ctx.verify_flags &= ~getattr(ssl, "VERIFY_X509_STRICT", 0)
    ctx.check_hostname = bool(args.get("ssl_verify_identity"))  # before verify_mode
    ctx.verify_mode = ssl.CERT_REQUIRED if args.get("ssl_verify_cert", True) else ssl.CERT_NONE
    if args.get("ssl_cert"):
        try:
            ctx.load_cert_chain(args["ssl_cert"], keyfile=args.get("ssl_key"))
        except (OSError, ssl.SSLError) as exc:
            raise LockError(
                f"ssl_cert={args['ssl_cert']!r} / ssl_key={args.get('ssl_key')!r} in "
                f"{where} cannot be loaded ({exc}); give the client certificate and its "
                "unencrypted key as PEM files"
            ) from exc
    return ctx


def connect_for_sqlalchemy(where: str, **cparams: Any) -> TlsFirstConnection:
    """The PyMySQL connection for a SQLAlchemy `mysql+pymysql://` URL (the effects
    database), its TLS options read as the lock URL's: `ssl_mode` understood, `ssl_ca`
    alone verifying chain and host name, and no login sent to a server offering no TLS.

    `cparams` are SQLAlchemy's, which folds ssl_ca/ssl_cert/ssl_key/ssl_capath/ssl_cipher/
    ssl_check_hostname into an `ssl` dict and passes other query options on as strings."""
    args = dict(cparams)
    folded = dict(args.pop("ssl", None) or {})
    options = {f"ssl_{k}": str(folded.pop(k)) for k in ("ca", "cert", "key") if k in folded}
    if "check_hostname" in folded:
        options["ssl_verify_identity"] = str(folded.pop("check_hostname"))
    for name in ("ssl_mode", "ssl_verify_cert", "ssl_verify_identity"):
        if name in args:
            options[name] = str(args.pop(name))
    capath, cipher = folded.pop("capath", None), folded.pop("cipher", None)
    if folded:
        raise LockError(f"unknown TLS option(s) {', '.join(sorted(folded))} in {where}")
    if (capath or cipher) and not any(k.startswith("ssl_") for k in options):
        options["ssl_verify_cert"] = "true"  # as PyMySQL: any TLS option asks for TLS
    if "ssl_disabled" in args:
        args["ssl_disabled"] = _flag("ssl_disabled", str(args["ssl_disabled"]), where)
    tls = tls_options(options, where)
    if tls.pop("ssl_disabled", False):
        args["ssl_disabled"] = True
    ctx = tls_context(tls, where)
    if ctx is not None:
        if args.get("ssl_disabled"):
            raise LockError(f"{where} gives ssl_disabled=true with TLS options: drop one")
        if capath:
            ctx.load_verify_locations(capath=str(capath))
        if cipher:
            ctx.set_ciphers(str(cipher))
        args["ssl"] = ctx
    return TlsFirstConnection(**args)


def _tls_asked(args: dict[str, Any]) -> bool:
    """`tls_options` spells out both verify flags whenever TLS is on."""
    return any(name in args for name in ("ssl_verify_cert", "ssl_verify_identity", *TLS_FILES))


def _security_of(args: dict[str, Any]) -> Security:
    tls = _tls_asked(args)
    return Security(
        tls=tls,
        verified=tls and bool(args.get("ssl_verify_cert", True)),
        hostname_checked=tls and bool(args.get("ssl_verify_identity")),
        auth=bool(args.get("password") or args.get("ssl_cert")),
    )


def connect_hint(exc: BaseException, host: str, user: str | None) -> str | None:
    """What to change when a connection to the MySQL server failed, else None.

    The TLS failures (untrusted certificate, wrong host name, no TLS on the server, a
    client certificate required) and a refused login each name the URL option to fix."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = getattr(cur, "original_exception", None) or cur.__cause__ or cur.__context__
    text = " ".join(str(e) for e in seen)
    verify = [e for e in seen if isinstance(e, ssl.SSLCertVerificationError)]
    if verify or "CERTIFICATE_VERIFY_FAILED" in text:
        why = (verify[0].verify_message if verify else "") or "untrusted"
        if (verify and verify[0].verify_code == 62) or "mismatch" in why:
            return (
                f"the MySQL server's TLS certificate is not valid for host {host!r} ({why}): "
                "connect by a name or address its certificate holds; or, a downgrade the "
                "start-up check warns about, add ssl_verify_identity=false to the lock URL"
            )
        return (
            f"the MySQL server's TLS certificate did not verify ({why}): pass the CA that "
            "signed it as ssl_ca=/path/ca.pem in the lock URL"
        )
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
    if code == 1045:
        return (
            f"the MySQL server refused the login of user {user!r}: check the user and password "
            "in the lock URL (percent-encoded); if the account REQUIREs X509 or SSL, pass "
            "ssl_cert=/path/client.pem&ssl_key=/path/client.key (and ssl_ca=) in the lock URL"
        )
    offered = [e for e in seen if isinstance(e, TlsNotOffered)]
    if offered:
        return (
            f"{offered[0].args[1]}: turn TLS on at the server (ssl_cert/ssl_key in its "
            "configuration); if it has TLS on, someone between this host and it strips it"
        )
    if "server doesn't support" in text.lower() and "ssl" in text.lower():
        return (
            "the MySQL server offers no TLS, which the lock URL's ssl_* options require: "
            "turn TLS on at the server (ssl_cert/ssl_key in its configuration)"
        )
    if any(isinstance(e, ssl.SSLError) for e in seen):
        return (
            "TLS handshake with the MySQL server failed: if it requires a client certificate, "
            "pass ssl_cert=/path/client.pem&ssl_key=/path/client.key in the lock URL"
        )
    return None
