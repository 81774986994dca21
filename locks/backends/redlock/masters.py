"""A Redlock master: its URL (address, login, db, TLS), its sync sockets and its set-up."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from jobfence.locks.backends.redis.url import tls_context, tls_kwargs, url_tls
from jobfence.locks.backends.redlock.protocol import MORE, Replies, pack

#: After a failed connect, a master is skipped (counted as not answering) this long.
RECONNECT_DELAY = 0.5


class Link(Replies):
    """One blocking-free socket to one master (TLS-wrapped for rediss://), for one sync
    operation at a time."""

    __slots__ = ("error", "fd", "sock", "tls")

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.fd = sock.fileno()
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.error: OSError | None = None  # why the last read failed

    def recv(self) -> bytes | None:
        """What the socket has now: None if nothing yet (for TLS, a record still partial,
        or a protocol message such as a session ticket with no data), b"" if it closed."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except OSError as exc:  # reset, or a TLS alert (a client certificate refused)
            self.error = exc
            return b""
        if self.tls and data:
            # Decrypted bytes the TLS layer holds already: poll() would not report them.
            sock: Any = self.sock
            while pending := sock.pending():
                data += sock.recv(pending)
        return data

    def send(self, data: bytes) -> bool:
        try:
            sent = self.sock.send(data)
        except OSError as exc:
            self.error = exc
            return False
        if sent != len(data):  # the master is so far behind its buffers are full
            return False
        self.owed += 1
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Master:
    """One Redlock master: its address, idle links, and a redis-py client for admin calls."""

    def __init__(self, url: str, *, socket_timeout: float, scripts: dict[str, str]) -> None:
        opts = parse_url(url)  # type: ignore[no-untyped-call]
        self.host = str(opts.get("host", "127.0.0.1"))
        self.port = int(opts.get("port", 6379))
        self.db = int(opts.get("db", 0) or 0)
        self.username = opts.get("username")
        self.password = opts.get("password")
        self.name = f"{self.host}:{self.port}"
        self.url = url
        self.socket_timeout = socket_timeout
        self.scripts = scripts
        # rediss://: our sockets wrapped in TLS, the certificate and the host name checked
        # (unless the URL turns a check off), as redis-py's client below does.
        self.tls = url_tls(url)
        self.ssl_context = tls_context(self.tls)
        tls = {k: v for k, v in tls_kwargs(self.tls).items() if k != "ssl"}
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            decode_responses=True,
            health_check_interval=0,
            retry=Retry(NoBackoff(), 0),
            **tls,
        )
        #: Why the last connection to this master failed (a TLS handshake, say), for the
        #: hint of BackendUnavailable; None once it answers again.
        self.last_error: BaseException | None = None
        self.idle: list[Link] = []
        self.pid = os.getpid()
        self.down_until = 0.0

    def checkout(self, pid: int) -> Link | None:
        """An idle link, or a new one; None while the master refuses connections."""
        if self.pid != pid:  # a forked child: the parent's sockets are not ours
            self.pid, self.idle = pid, []
        try:
            return self.idle.pop()
        except IndexError:
            pass
        if time.monotonic() < self.down_until:
            return None
        try:
            return self.connect()
        except OSError as exc:
            self.last_error = exc
            self.down_until = time.monotonic() + RECONNECT_DELAY
            return None

    def checkin(self, link: Link, pid: int) -> None:
        if self.pid == pid:
            self.idle.append(link)

    def connect(self) -> Link:
        """A new link, its set-up (AUTH, SELECT, every script) sent but not waited for.

        The set-up's replies are read, and dropped, ahead of the first command's, so a
        master that is frozen costs no more than one that is slow; a failed AUTH shows as
        the NOAUTH error of the commands after it.
        """
        sock = socket.create_connection((self.host, self.port), timeout=self.socket_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:  # the handshake, blocking, within the timeout
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
            setup = self.setup()
            sock.setblocking(False)
            link = Link(sock)
            if not link.send(b"".join(setup)):
                raise ConnectionError(f"redlock master {self.name}: set-up not sent "
                                      f"({link.error})") from link.error  # fmt: skip
            link.owed = len(setup)
            return link
        except BaseException:
            sock.close()
            raise

    def setup(self) -> list[bytes]:
        """What a new connection sends first, without waiting: AUTH, SELECT, every script."""
        setup: list[bytes] = []
        if self.password:
            auth = (self.username, self.password) if self.username else (self.password,)
            setup.append(pack("AUTH", *auth))
        if self.db:
            setup.append(pack("SELECT", self.db))
        return setup + self.script_loads()

    def script_loads(self) -> list[bytes]:
        return [pack("SCRIPT", "LOAD", src) for src in self.scripts.values()]

    def close(self, deadline: float) -> None:
        """Read what idle links still owe (until `deadline`), then close everything."""
        idle, self.idle = self.idle, []
        if self.pid == os.getpid():
            for link in idle:
                _drain(link, deadline)
                link.close()
        self.client.close()


def _drain(link: Link, deadline: float) -> None:
    while link.owed:
        try:
            got = link.take()
        except ValueError:
            return
        if got is not MORE:
            continue
        left = deadline - time.monotonic()
        poller = select.poll()
        poller.register(link.fd, select.POLLIN)
        if left <= 0 or not poller.poll(left * 1000):
            return
        data = link.recv()
        if data == b"":
            return
        link.buf += data or b""

