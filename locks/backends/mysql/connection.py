"""Reaching the MySQL/MariaDB server: the URL's connect arguments, idle connections, fix hints.

A new session is set up as the lock statements need it (UTC, READ COMMITTED, bounded waits).
"""

from __future__ import annotations

import contextlib
import os
import select
import ssl
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import pymysql  # type: ignore[import-untyped]  # PyMySQL ships no type hints
from pymysql.constants import CLIENT  # type: ignore[import-untyped]

# The error classes PyMySQL raises, bound from sys.modules["pymysql.err"]: once Django (or
# anyone) runs pymysql.install_as_MySQLdb() and imports MySQLdb.constants, a second copy
# of pymysql/err.py is loaded as MySQLdb.err and replaces the `pymysql.err` attribute, so
# `except pymysql.err.MySQLError` would stop matching what connections raise.
from pymysql.err import Error as PyMySQLError  # type: ignore[import-untyped]
from pymysql.err import OperationalError as PyMySQLOperationalError  # type: ignore[import-untyped]

from jobfence.locks import registry
from jobfence.locks.backends.mysql.tls import TlsFirstConnection, TlsNotOffered, tls_options
from jobfence.locks.errors import LockError

SCHEMES = registry.entry("mysql").schemes  # the registry is the one list
DEFAULT_PORT = 3306
# PyMySQL's spellings, and MySQL's own `ssl_mode` (as the mysql client and Connector/J).
URL_OPTIONS = (
    "unix_socket", "ssl_ca", "ssl_cert", "ssl_key", "ssl_verify_cert", "ssl_verify_identity",
    "ssl_mode",
)  # fmt: skip


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


def open_session(
    args: dict[str, Any], timeout: float, tls: bool
) -> pymysql.connections.Connection[Any]:
    """A new connection with `args`, its session as the lock statements need it; `tls`:
    refused unless its socket is TLS."""
    conn = TlsFirstConnection(
        **args,
        charset="utf8mb4",
        autocommit=True,
        connect_timeout=max(1, int(timeout + 0.999)),
        read_timeout=timeout,
        write_timeout=timeout,
        # MULTI_STATEMENTS: a transaction in one round trip. FOUND_ROWS: an UPDATE
        # reports the rows it matched, not only those it changed.
        client_flag=CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS,
    )
    if tls and not isinstance(getattr(conn, "_sock", None), ssl.SSLSocket):
        # Unreachable (TlsFirstConnection refused before the login): a last guard.
        discard(conn)
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


class Pool:
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
            discard(conn)

    def put(self, conn: pymysql.connections.Connection[Any]) -> None:
        if self.pid == os.getpid():
            self.idle.append(conn)

    def close(self) -> None:
        idle, self.idle = self.idle, []
        if self.pid == os.getpid():
            for conn in idle:
                with contextlib.suppress(PyMySQLError):
                    conn.close()


def discard(conn: pymysql.connections.Connection[Any]) -> None:
    """Drop a connection in an unknown state: close its socket without a goodbye."""
    with contextlib.suppress(Exception):  # already broken
        conn._force_close()  # the public close() says goodbye over the socket first


def connect_hint(exc: BaseException, host: str, user: str | None) -> str | None:
    """What to change when a connection to the MySQL server failed, else None.

    The TLS failures (untrusted certificate, wrong host name, no TLS on the server, a
    client certificate required) and a refused login each name the URL option to fix."""
    seen = _causes(exc)
    text = " ".join(str(e) for e in seen)
    verify = [e for e in seen if isinstance(e, ssl.SSLCertVerificationError)]
    if verify or "CERTIFICATE_VERIFY_FAILED" in text:
        return _untrusted_hint(verify, host)
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


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it wraps (SQLAlchemy's original, then causes and contexts), up to 8."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = getattr(cur, "original_exception", None) or cur.__cause__ or cur.__context__
    return seen


def _untrusted_hint(verify: list[ssl.SSLCertVerificationError], host: str) -> str:
    """The hint for a server certificate that did not verify: another host's, or untrusted."""
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
