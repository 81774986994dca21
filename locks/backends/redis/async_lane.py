"""The asyncio lane: one pipelined connection to a Redis server for the asyncio store's scripts.

redis.asyncio checks a connection out of its pool for every command and reads the reply
through layers of stream and timeout machinery: on a loopback server that costs about twice
the sync lane's round trip (issue 33). The lane is the sync `Lane`'s asyncio twin: one
connection of its own (asyncio.Protocol, hiredis's C packer and reader), shared by every
coroutine of the store and pipelined, each command's reply handed back in order to its
future. A command whose caller stopped waiting (its timeout, a cancel) leaves its future
behind and the reply is dropped when it comes, so the stream never falls out of step and
nothing sent is ever sent again. A lost connection fails what it owed (the store says
BackendUnavailable) and the next command connects again; another event loop (a second
`asyncio.run`) gets a connection of its own.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:  # redis-py's own table of error replies (NOSCRIPT -> NoScriptError, ...)
    from redis._parsers.base import BaseParser

    _typed_error: Any = BaseParser.parse_error
except ImportError:  # pragma: no cover - an older or newer redis-py lays it out otherwise
    _typed_error = ResponseError

_LOST: Any = object()  # the reply of a command whose connection was lost
_LATE: Any = object()  # the reply of a command not answered within the timeout


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(_LATE)


@dataclass(frozen=True)
class Address:
    """Where the lane connects and how it logs in: the sync client's own options (its
    pool's connection_kwargs), so both reach the same server as the same user."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket instead of host and port
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: ssl.SSLContext | None = None

    @classmethod
    def of(cls, kwargs: dict[str, Any], tls: ssl.SSLContext | None) -> Address:
        return cls(
            host=str(kwargs.get("host") or "localhost"),
            port=int(kwargs.get("port") or 6379),
            path=kwargs.get("path"),
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            db=int(kwargs.get("db") or 0),
            tls=tls,
        )

    def login(self) -> list[tuple[Any, ...]]:
        """What a new connection sends first, each answered before any command: AUTH, SELECT."""
        out: list[tuple[Any, ...]] = []
        if self.password:
            out.append(("AUTH", self.username, self.password) if self.username
                       else ("AUTH", self.password))  # fmt: skip
        if self.db:
            out.append(("SELECT", self.db))
        return out

    def __repr__(self) -> str:  # never the password
        where = self.path or f"{self.host}:{self.port}"
        return f"Address({where}, db={self.db}, tls={self.tls is not None})"


class Wire(asyncio.Protocol):
    """One connection: commands written in order, each reply set on the oldest future."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(encoding="utf-8")
        self.futures: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (value := self.reader.gets()) is not False:
                if not self.futures:  # a reply nobody asked for: out of step
                    self.close()
                    return
                future = self.futures.popleft()
                if not future.done():  # else its caller stopped waiting: dropped
                    future.set_result(value)
        except hiredis.ProtocolError:  # not RESP: out of step
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        futures, self.futures = self.futures, deque()
        for future in futures:
            if not future.done():
                future.set_result(_LOST)

    @property
    def live(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def send(self, data: bytes) -> asyncio.Future[Any]:
        """Write one packed command; its reply (or _LOST) comes on the future returned."""
        # No cap on what is owed: each caller's own timeout bounds its wait, and a loop of
        # many thousand coroutines is served in order rather than failed together.
        future = asyncio.get_running_loop().create_future()
        if not self.live:
            future.set_result(_LOST)
            return future
        assert self.transport is not None
        self.transport.write(data)
        self.futures.append(future)
        return future

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class AsyncLane:
    """One Redis server's pipelined connection for the asyncio store (see the module)."""

    def __init__(self, address: Address, timeout: float) -> None:
        self.address = address
        self.timeout = timeout  # for the connect and login, and for each reply
        self.wire: Wire | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connecting: asyncio.Task[Wire] | None = None

    async def call(self, *args: Any) -> Any:
        """One command's reply; an error reply raised as redis-py types it (NoScriptError,
        ...), a lost connection as ConnectionError, no reply in time as TimeoutError."""
        wire = self.wire
        if wire is None or not wire.live or self.loop is not asyncio.get_running_loop():
            wire = await self._connected()
        return await self._reply(wire.send(hiredis.pack_command(args)))

    async def _reply(self, future: asyncio.Future[Any]) -> Any:
        # The future is this caller's alone: past the timeout it is answered "late" (the
        # reply, when it comes, finds it done and is dropped). A timer handle, not
        # asyncio.timeout, whose task-cancel machinery costs a tenth of the round trip.
        timer = asyncio.get_running_loop().call_later(self.timeout, _expire, future)
        try:
            value = await future
        finally:
            timer.cancel()
        if value is _LATE:
            raise RedisTimeoutError(f"no reply from redis in {self.timeout:g}s")
        if value is _LOST:
            raise RedisConnectionError(f"connection to redis {self.address!r} lost")
        if isinstance(value, hiredis.ReplyError):
            raise _typed_error(str(value))
        return value

    async def _connected(self) -> Wire:
        """The live connection, made now if needed (one connect at a time per loop)."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:  # another event loop: the old one's transports are not ours
            self.loop, self.wire, self.connecting = loop, None, None
        if self.connecting is None or self.connecting.done():
            self.connecting = loop.create_task(self._connect(), name="jobfence-redis-connect")
            # Retrieved here, so a failure all of whose callers were cancelled is not
            # reported as never retrieved; each caller still gets it through the shield.
            self.connecting.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(self.connecting)

    async def _connect(self) -> Wire:
        a, loop = self.address, asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                if a.path:
                    _, wire = await loop.create_unix_connection(Wire, a.path)
                else:
                    tls: dict[str, Any] = {}
                    if a.tls is not None:
                        tls = {"ssl": a.tls, "server_hostname": a.host}
                    _, wire = await loop.create_connection(Wire, a.host, a.port, **tls)
                try:
                    for command in a.login():
                        await self._reply(wire.send(hiredis.pack_command(command)))
                except BaseException:
                    wire.close()
                    raise
        except TimeoutError:
            raise RedisTimeoutError(f"timed out connecting to redis {a!r}") from None
        except OSError as exc:  # refused, unreachable, a TLS handshake that failed
            raise RedisConnectionError(f"error connecting to redis {a!r}: {exc}") from exc
        self.wire = wire
        return wire

    def close(self) -> None:
        """Close the connection (of the running loop's; another loop's is forgotten)."""
        wire, self.wire = self.wire, None
        task, self.connecting = self.connecting, None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is self.loop:
            if task is not None and not task.done():
                task.cancel()
            if wire is not None:
                wire.close()
