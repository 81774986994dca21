"""Fake MySQL and PostgreSQL servers that offer no TLS and record what a client sends them."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType

from devstack.servers import wait_for

# MySQL capability flags (the protocol's, as PyMySQL's pymysql.constants.CLIENT).
LONG_PASSWORD, CONNECT_WITH_DB, PROTOCOL_41, SSL = 1, 8, 512, 2048
SECURE_CONNECTION, PLUGIN_AUTH = 32768, 1 << 19
# PostgreSQL start-up codes.
SSL_REQUEST, GSS_REQUEST = 80877103, 80877104


class FakeServer:
    """A TCP listener on `host` (a free port) serving each client in turn with `_serve`;
    `received` holds every byte each client sent, `seen` the clients served to the end."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.2)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self.received: list[bytes] = []
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()

    def got(self, secret: str) -> bool:
        """Whether any client sent `secret` (once every client so far was served)."""
        return any(secret.encode() in data for data in self.received)

    def served(self, clients: int) -> None:
        wait_for(lambda: self.seen >= clients, 5, message=f"{clients} client(s) not served")

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            data = bytearray()
            with conn:
                conn.settimeout(5)
                # The client hung up (a refusal): what it sent is recorded all the same.
                with contextlib.suppress(OSError, struct.error, EOFError):
                    self._serve(conn, data)
            self.received.append(bytes(data))
            self.seen += 1

    def _serve(self, conn: socket.socket, data: bytearray) -> None:
        raise NotImplementedError

    @staticmethod
    def _read(conn: socket.socket, n: int, data: bytearray) -> bytes:
        out = b""
        while len(out) < n:
            chunk = conn.recv(n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
            data += chunk
        return out


class FakeMySQL(FakeServer):
    """Greets with protocol v10 without the SSL capability and `mysql_native_password`,
    then asks the client to switch to `mysql_clear_password` (the password itself) and
    refuses the login: what a man in the middle stripping TLS does."""

    def _serve(self, conn: socket.socket, data: bytearray) -> None:
        caps = LONG_PASSWORD | CONNECT_WITH_DB | PROTOCOL_41 | SECURE_CONNECTION | PLUGIN_AUTH
        salt = b"abcdefgh" + b"ijklmnopqrst"
        greeting = (
            b"\x0a" + b"8.0.99-fake\0" + struct.pack("<I", 7) + salt[:8] + b"\0"
            + struct.pack("<H", caps & 0xFFFF) + bytes([45]) + struct.pack("<H", 2)
            + struct.pack("<H", caps >> 16) + bytes([21]) + b"\0" * 10
            + salt[8:] + b"\0" + b"mysql_native_password\0"
        )  # fmt: skip
        self._packet(conn, 0, greeting)
        seq, _response = self._packet_in(conn, data)  # the login (or a TLS request)
        self._packet(conn, seq + 1, b"\xfe" + b"mysql_clear_password\0")
        seq, _password = self._packet_in(conn, data)
        error = b"\xff" + struct.pack("<H", 1045) + b"#28000" + b"Access denied"
        self._packet(conn, seq + 1, error)

    @staticmethod
    def _packet(conn: socket.socket, seq: int, payload: bytes) -> None:
        conn.sendall(struct.pack("<I", len(payload))[:3] + bytes([seq & 0xFF]) + payload)

    def _packet_in(self, conn: socket.socket, data: bytearray) -> tuple[int, bytes]:
        head = self._read(conn, 4, data)
        size = int.from_bytes(head[:3], "little")
        return head[3], self._read(conn, size, data)


class FakePostgres(FakeServer):
    """Answers an SSL or GSS request with "N" (no TLS), then asks for the password in clear
    text (AuthenticationCleartextPassword) and refuses the login."""

    def _serve(self, conn: socket.socket, data: bytearray) -> None:
        while True:
            size = struct.unpack("!I", self._read(conn, 4, data))[0]
            body = self._read(conn, size - 4, data)
            if struct.unpack("!I", body[:4])[0] in (SSL_REQUEST, GSS_REQUEST):
                conn.sendall(b"N")
                continue
            break  # the StartupMessage
        conn.sendall(b"R" + struct.pack("!II", 8, 3))
        kind = self._read(conn, 1, data)
        size = struct.unpack("!I", self._read(conn, 4, data))[0]
        self._read(conn, size - 4, data)
        if kind == b"p":
            fields = b"SFATAL\0C28P01\0Mpassword authentication failed\0\0"
            conn.sendall(b"E" + struct.pack("!I", 4 + len(fields)) + fields)
