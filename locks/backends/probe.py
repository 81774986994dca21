"""Which server answers at a lock URL's address, when it does not answer as the URL says.

A `redis://` URL pointed at RabbitMQ's or PostgreSQL's port, or a `postgresql://` or
`mysql://` URL pointed at Redis's, is a wrong setting, not an outage: waiting never helps.
Only a server positively known to be something else is named (its own greeting or reply
to a probe); a connection closed without a word stays an outage.
"""

from __future__ import annotations

import socket
import struct
from urllib.parse import urlsplit

from jobfence.config.findings import Finding, LockTarget, refuse
from jobfence.config.schemes import backend_schemes
from jobfence.config.urls import redact

#: PostgreSQL's SSLRequest: length 8, code 80877103; a PostgreSQL server answers b"S" or b"N".
PG_SSL_REQUEST = struct.pack("!II", 8, 80877103)


def _exchange(host: str, port: int, payload: bytes | None, timeout: float) -> bytes | None:
    """What the server at host:port says first (payload None) or to `payload`; None if it
    cannot be reached, b"" if it says nothing before closing or the timeout."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            if payload is not None:
                sock.sendall(payload)
            try:
                return sock.recv(64)
            except (TimeoutError, ConnectionResetError):
                return b""
    except OSError:
        return None


def foreign_server(host: str, port: int, timeout: float = 1.0) -> str | None:
    """A description of the non-Redis server listening at host:port, or None if none is
    known to be there (Redis itself, nothing listening, or a server that says nothing)."""
    greeting = _exchange(host, port, None, min(timeout, 0.3))  # Redis speaks only when asked
    if greeting is None:
        return None
    if greeting:
        return _named(greeting) or "a server that greets first, as Redis never does"
    reply = _exchange(host, port, b"*1\r\n$4\r\nPING\r\n", timeout)
    if reply and reply[:1] in b"+-$*:_,#!=(%~>|":
        return None  # RESP: Redis (or a Redis-speaking proxy) answered
    if reply:
        return _named(reply) or f"a server that does not speak Redis's protocol ({reply[:1]!r})"
    if _exchange(host, port, PG_SSL_REQUEST, timeout) in (b"S", b"N"):
        return "PostgreSQL"
    return None


def _named(data: bytes) -> str | None:
    if data.startswith(b"AMQP"):
        return "an AMQP broker (RabbitMQ)"
    if data.startswith((b"HTTP/", b"<")):
        return "an HTTP server"
    if data.startswith(b"SSH-"):
        return "an SSH server"
    if len(data) > 5 and data[4] == 10:  # MySQL's handshake v10 after a 4-byte header
        return "MySQL/MariaDB"
    return None


def foreign_sql_server(host: str, port: int, expected: str, timeout: float = 1.0) -> str | None:
    """A description of the server at host:port if it is positively not `expected`
    ("PostgreSQL" or "MySQL/MariaDB"): None for the expected server itself, for nothing
    listening, and for a server that says nothing to any probe (an outage, not a wrong URL)."""
    greeting = _exchange(host, port, None, min(timeout, 0.3))  # MySQL greets; PostgreSQL waits
    if greeting is None:
        return None
    if greeting:
        named = _named(greeting)
        return None if named in (expected, None) else named
    reply = _exchange(host, port, PG_SSL_REQUEST, timeout)
    if reply in (b"S", b"N"):
        return None if expected == "PostgreSQL" else "PostgreSQL"
    if reply and (named := _named(reply)) is not None:  # RabbitMQ answers with its header
        return None if named == expected else named
    reply = _exchange(host, port, b"*1\r\n$4\r\nPING\r\n", timeout)
    if reply and reply[:1] in b"+-":
        return "Redis"
    named = _named(reply) if reply else None
    return None if named == expected else named


#: The scheme to use for each server named above, where jobfence has one.
SCHEME_FOR = {
    "PostgreSQL": f"{backend_schemes('postgres').plain}://",
    "MySQL/MariaDB": f"{backend_schemes('mysql').plain}://",
    "Redis": f"{backend_schemes('redis').plain}://",
}


def foreign_fix(foreign: str, setting: str, expected: str = "Redis", port: int = 6379) -> str:
    """The fix of a lock URL (`setting`) whose address answers as `foreign`, not `expected`."""
    fix = f"point {setting} at your {expected} server's address and port ({port} by default)"
    scheme = SCHEME_FOR.get(foreign)
    return fix + (f", or use a {scheme} URL to keep locks in {foreign}" if scheme else "")


def foreign_sql_refusal(target: LockTarget, expected: str, default_port: int) -> Finding | None:
    """The refusal of a SQL lock URL whose address answers as another server (a
    `postgresql://` URL at Redis's port): a wrong setting, never an outage to wait out."""
    parts = urlsplit(target.url)
    if not parts.hostname:  # a socket directory or ?host=: nothing to probe by address
        return None
    try:
        port = parts.port or default_port
    except ValueError:
        return None
    foreign = foreign_sql_server(parts.hostname, port, expected)
    if foreign is None:
        return None
    return refuse(
        target.setting,
        f"{redact(target.url)} answers, but as {foreign}, not a {expected} server",
        foreign_fix(foreign, target.setting, expected, default_port),
    )
