"""The asyncio store's side of a Redlock master: one pipelined connection shared by every
op, made on first use, and a redis.asyncio client for the waits on release signals."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any, cast

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from jobfence.locks.backends.redis.async_store import POOL_WAIT
from jobfence.locks.backends.redis.protocol import client_options
from jobfence.locks.backends.redis.url import tls_kwargs
from jobfence.locks.backends.redlock.masters import RECONNECT_DELAY, Master
from jobfence.locks.backends.redlock.protocol import MORE, NO_REPLY, Replies

#: Replies one master's connection may owe before that master is treated as down. The
#: connection is shared by every op of the store, so this is far above a sync link's.
MAX_BEHIND = 4096
#: Bytes written to a master that its socket has not taken yet, before it is treated as down.
MAX_BUFFERED = 4 << 20


class Conn(Replies, asyncio.Protocol):
    """One connection to one master, shared by every op of the store and pipelined.

    Commands go out in the order the ops write them and each reply comes back, in that
    order, to its future (None: a set-up reply nobody awaits). An op that stops waiting
    (decided, past its deadline, cancelled) leaves its future behind: the reply is dropped
    when it comes, and what was written after it (a release) still runs after it there.
    Not redis-py's connections, for the reason the sync driver gives (links.py): they
    drop a connection whose reply is late, and with it the order of what was sent.
    """

    def __init__(self) -> None:
        super().__init__()
        self.futures: deque[asyncio.Future[Any] | None] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.master: Master | None = None  # told why the connection was lost, if by an error

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            while self.futures:
                value = self.take()
                if value is MORE:
                    return
                future = self.futures.popleft()
                if future is not None and not future.done():
                    future.set_result(value)
        except ValueError:  # not RESP: the stream is out of step
            self.close()
            return
        if self.buf:  # a reply nobody asked for: out of step
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self.master is not None:
            self.master.last_error = exc  # a TLS alert, say: for BackendUnavailable's hint
        self.lost = True
        self.owed = 0
        futures, self.futures = self.futures, deque()
        for future in futures:
            if future is not None and not future.done():
                future.set_result(NO_REPLY)

    @property
    def live(self) -> bool:
        transport = self.transport
        return not self.lost and transport is not None and not transport.is_closing()

    def send(self, data: bytes, *, dropped: int = 0) -> asyncio.Future[Any] | None:
        """Write `data`: `dropped` commands whose replies nobody awaits, then the one whose
        reply the future gets. None if the master is gone, or so far behind that it is
        treated as down (the connection closes once what was written has gone out)."""
        transport = self.transport
        if transport is None or not self.live:
            return None
        if self.owed > MAX_BEHIND or transport.get_write_buffer_size() > MAX_BUFFERED:
            self.close()
            return None
        transport.write(data)
        future = asyncio.get_running_loop().create_future()
        self.futures.extend([None] * dropped)
        self.futures.append(future)
        self.owed += dropped + 1
        return future

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()  # what is buffered still goes out, in order


class AsyncMaster:
    """One master for the asyncio store: its shared connection, made on first use (again
    after a failure, no sooner than RECONNECT_DELAY), and a redis.asyncio client for
    waiting on release signals (a BLPOP holds a connection of its own)."""

    def __init__(self, master: Master, socket_timeout: float, max_connections: int) -> None:
        self.master = master
        self.socket_timeout = socket_timeout
        self.conn: Conn | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.down_until = 0.0
        options = {**client_options(socket_timeout), "retry": Retry(NoBackoff(), 0)}
        options.update((k, v) for k, v in tls_kwargs(master.tls).items() if k != "ssl")
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            master.url, max_connections=max_connections, timeout=POOL_WAIT, **options
        )
        self.client = redis.asyncio.Redis(connection_pool=pool)

    def live(self) -> Conn | None:
        conn = self.conn
        return conn if conn is not None and conn.live else None

    def connect_task(self) -> asyncio.Task[None] | None:
        """The connect under way (started now if needed); None while connected or down."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:  # another event loop (a second asyncio.run): start afresh
            self.loop, self.conn, self.connecting = loop, None, None
        if self.live() is not None or time.monotonic() < self.down_until:
            return None
        if self.connecting is None or self.connecting.done():
            self.connecting = loop.create_task(self._connect(), name="jobfence-redlock-connect")
        return self.connecting

    async def _connect(self) -> None:
        """Connect, and send the set-up (AUTH, SELECT, every script) without waiting for
        it, as the sync backend does: a frozen master costs an op no more than a slow one."""
        m = self.master
        tls: dict[str, Any] = {}
        if m.ssl_context is not None:  # rediss://: the checks of the sync backend's sockets
            tls = {"ssl": m.ssl_context, "server_hostname": m.host}
        try:
            async with asyncio.timeout(self.socket_timeout):
                _, conn = await asyncio.get_running_loop().create_connection(
                    Conn, m.host, m.port, **tls
                )
        except (OSError, TimeoutError) as exc:
            m.last_error = exc
            self.down_until = time.monotonic() + RECONNECT_DELAY
            return
        conn.master = m
        setup = m.setup()
        if setup:
            conn.send(b"".join(setup), dropped=len(setup) - 1)
        self.conn = conn

    async def aclose(self) -> None:
        task, self.connecting = self.connecting, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.conn is not None and self.loop is asyncio.get_running_loop():
            self.conn.close()
        self.conn = None
        await self.client.aclose()
