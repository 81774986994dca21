"""Cutting a database connection at a chosen moment: its session killed before a statement,
or a TCP proxy to PostgreSQL that lets one COMMIT through and loses its reply."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import sqlalchemy as sa

from tests.servers import HOST

WAIT_GONE = 30.0  # generous: a loaded 2-core box


def kill_session(admin: sa.Engine, dbapi_connection: Any) -> None:
    """Kill the server session behind `dbapi_connection` from `admin`'s own connection, and
    return once it is gone (pg_terminate_backend on PostgreSQL, KILL on MySQL/MariaDB)."""
    with admin.connect() as other:
        if admin.dialect.name == "postgresql":
            pid = dbapi_connection.info.backend_pid
            gone = other.scalar(sa.text("SELECT pg_terminate_backend(:p, 30000)"), {"p": pid})
            assert gone, f"backend {pid} still there"
            return
        thread = dbapi_connection.thread_id()
        other.execute(sa.text(f"KILL {int(thread)}"))
        deadline = time.monotonic() + WAIT_GONE
        query = sa.text("SELECT COUNT(*) FROM information_schema.processlist WHERE id = :t")
        while other.scalar(query, {"t": thread}):
            assert time.monotonic() < deadline, f"session {thread} still there"
            time.sleep(0.02)


def kill_session_at(engine: sa.Engine, admin: sa.Engine, statement: str) -> threading.Event:
    """Kill the session of the next connection of `engine` about to send a statement whose
    SQL contains `statement` ("COMMIT": the transaction's COMMIT), just before it is sent:
    the statement never runs and the transaction never commits. Set once it fired."""
    cutter = SessionCutter(engine, admin)
    cutter.arm(statement)
    return cutter.fired


class SessionCutter:
    """`kill_session_at`, armed again and again on one engine: each `arm(statement)` kills
    the session of the next connection about to send a statement containing `statement`
    ("COMMIT": its COMMIT), once; `disarm()` takes back an arming that has not fired."""

    def __init__(self, engine: sa.Engine, admin: sa.Engine) -> None:
        self.engine = engine
        self.admin = admin
        self.fired = threading.Event()  # the last arming fired
        self.fires = 0  # every arming that fired
        self._armed: str | None = None
        self._lock = threading.Lock()
        sa.event.listen(engine, "before_cursor_execute", self._before_execute)
        sa.event.listen(engine, "commit", self._before_commit)

    def arm(self, statement: str) -> None:
        with self._lock:
            self._armed = statement
            self.fired.clear()

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def close(self) -> None:
        self.disarm()
        sa.event.remove(self.engine, "before_cursor_execute", self._before_execute)
        sa.event.remove(self.engine, "commit", self._before_commit)

    def _claim(self, sql: str | None) -> bool:
        """Whether this statement (None: the COMMIT) is the armed one; then disarmed."""
        with self._lock:
            armed = self._armed
            if armed == "COMMIT":
                hit = sql is None
            else:
                hit = armed is not None and sql is not None and armed in sql
            if hit:
                self._armed = None
            return hit

    def _kill(self, conn: sa.Connection) -> None:
        kill_session(self.admin, conn.connection.driver_connection)
        self.fires += 1
        self.fired.set()

    def _before_execute(self, conn: sa.Connection, _cur: Any, sql: str, *_: Any) -> None:
        if self._claim(sql):
            self._kill(conn)

    def _before_commit(self, conn: sa.Connection) -> None:
        if self._claim(None):
            self._kill(conn)


class CommitReplyCutter:
    """A TCP proxy to PostgreSQL that, once armed, forwards the next COMMIT, swallows the
    server's reply and closes both sides: the commit landed, the client saw the link die."""

    def __init__(self, port: int) -> None:
        self.target = (HOST, port)
        self.armed = threading.Event()
        self.fired = threading.Event()
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            cut = threading.Event()
            threading.Thread(target=self._up, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, cut), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, cut: threading.Event) -> None:
        while data := _recv(client):
            # psycopg sends COMMIT as a simple query: 'Q', length, the text, NUL.
            if self.armed.is_set() and b"COMMIT\x00" in data:
                self.armed.clear()
                cut.set()
            if not _send(server, data):
                break
        _close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        while data := _recv(server):
            if cut.is_set():  # the COMMIT's reply: never delivered
                _close(client, server)
                self.fired.set()
                return
            if not _send(client, data):
                break
        _close(client, server)

    def close(self) -> None:
        self._closing = True
        self._listener.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
