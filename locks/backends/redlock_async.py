"""The asyncio Redlock store: the sync backend's rounds (scripts, quorum, fence) on asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any, ClassVar, TypeVar, cast

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from jobfence.locks import ops
from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    NativeAsyncStore,
    Security,
    check_swap,
    settle_extensions,
    validate_key,
    validate_ttl,
)
from jobfence.locks.backends.redis.async_store import POOL_WAIT
from jobfence.locks.backends.redis.protocol import client_options
from jobfence.locks.backends.redis.signal_wait import SignalWait
from jobfence.locks.backends.redis.url import tls_kwargs
from jobfence.locks.backends.redlock import (
    _MORE,
    NO_REPLY,
    RECONNECT_DELAY,
    Done,
    RedlockBackend,
    Replies,
    Round,
    Rounds,
    _Master,
    _pack,
    advance,
    is_noscript,
)
from jobfence.locks.errors import LockError
from jobfence.locks.lease import OwnerMeta

T = TypeVar("T")

#: Replies one master's connection may owe before that master is treated as down. The
#: connection is shared by every op of the store, so this is far above a sync link's.
MAX_BEHIND = 4096
#: Bytes written to a master that its socket has not taken yet, before it is treated as down.
MAX_BUFFERED = 4 << 20


class _Conn(Replies, asyncio.Protocol):
    """One connection to one master, shared by every op of the store and pipelined.

    Commands go out in the order the ops write them and each reply comes back, in that
    order, to its future (None: a set-up reply nobody awaits). An op that stops waiting
    (decided, past its deadline, cancelled) leaves its future behind: the reply is dropped
    when it comes, and what was written after it (a release) still runs after it there.
    Not redis-py's connections, for the reason the sync backend gives (redlock.py): they
    drop a connection whose reply is late, and with it the order of what was sent.
    """

    def __init__(self) -> None:
        super().__init__()
        self.futures: deque[asyncio.Future[Any] | None] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.master: _Master | None = None  # told why the connection was lost, if by an error

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            while self.futures:
                value = self.take()
                if value is _MORE:
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


class _AsyncMaster:
    """One master for the asyncio store: its shared connection, made on first use (again
    after a failure, no sooner than RECONNECT_DELAY), and a redis.asyncio client for
    waiting on release signals (a BLPOP holds a connection of its own)."""

    def __init__(self, master: _Master, socket_timeout: float, max_connections: int) -> None:
        self.master = master
        self.socket_timeout = socket_timeout
        self.conn: _Conn | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.down_until = 0.0
        options = {**client_options(socket_timeout), "retry": Retry(NoBackoff(), 0)}
        options.update((k, v) for k, v in tls_kwargs(master.tls).items() if k != "ssl")
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            master.url, max_connections=max_connections, timeout=POOL_WAIT, **options
        )
        self.client = redis.asyncio.Redis(connection_pool=pool)

    def live(self) -> _Conn | None:
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
                    _Conn, m.host, m.port, **tls
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


class AsyncRedlockStore(NativeAsyncStore):
    """Redlock for asyncio: every op is one of RedlockBackend's flows of rounds (the same
    scripts, keys, quorum, validity and fence), each round sent to the N masters at once
    on one pipelined connection per master and awaited until decided or its deadline. So
    sync and async holders of one key exclude each other and share one fence space.

    Cancellation: an op that is cancelled stops waiting; a grant cancelled mid-way queues
    its release on every master behind its own commands (so it runs after them), as an
    interrupted sync grant does. A master that does not answer (down, SIGSTOPped) costs an
    op at most its deadline, and the loop nothing.

    It keeps a RedlockBackend on the same masters (`backend`, connected only if used) for
    the flows, the key layout and the fence floor; its leases name that backend, so
    `lease.release()` from a thread still works.
    """

    backend: RedlockBackend  # the sync twin (NativeAsyncStore)
    name: ClassVar[str] = "redlock"
    capabilities: ClassVar[Capabilities] = RedlockBackend.capabilities

    def __init__(self, backend: RedlockBackend, *, max_connections: int = 32) -> None:
        self.backend = backend
        self.keys = backend.keys
        self.clock = backend.clock
        self.masters = [
            _AsyncMaster(m, backend.socket_timeout, max_connections) for m in backend.masters
        ]
        self._signals = SignalWait(max_connections, backend.socket_timeout)
        self._wait_on = 0  # the master waiters block on; moves on when it fails

    @classmethod
    def from_url(cls, url: str, *, max_connections: int = 32, **options: Any) -> AsyncRedlockStore:
        """`redlock://[user:password@]host:port,host:port,host:port[,...][/db]`; `options`
        are RedlockBackend.from_url's (prefix, socket_timeout, fence_retention, clock ...)."""
        return cls(RedlockBackend.from_url(url, **options), max_connections=max_connections)

    async def execute_async(self, op: ops.StoreOp) -> Any:
        """One op (locks/ops.py); the replies are RedlockBackend.execute's."""
        backend = self.backend
        match op:
            case ops.Begin():
                return await self.begin_op(op)
            case ops.Commit():
                return await self.commit_op(op)
            case ops.Acquire(key, ttl, owner, meta):
                return await self._begin(key, ttl, owner, meta, False, "")
            case ops.WaitRelease(key, timeout):
                return await self._wait(key, timeout)
            case ops.Extend(leases):
                if not leases:
                    return []
                started = self.clock.monotonic()
                items = [(le.key, le.owner, validate_ttl(le.ttl)) for le in leases]
                extended = await self._run(backend.extend_many_rounds(items))
                return settle_extensions(leases, extended, started)
            case ops.Release(lease):
                if lease.released:
                    return False
                try:
                    return await self._run(backend.release_rounds(lease.key, lease.owner))
                finally:
                    lease._released = True
            case ops.ReleaseOwner(key, owner):
                validate_key(key)
                return await self._run(backend.release_rounds(key, owner))
            case ops.Inspect(key):
                validate_key(key)
                return await self._run(backend.inspect_rounds(key))
            case ops.ClaimPublish(key, task_id, ttl):
                return await self._run(backend.claim_publish_rounds(key, task_id, ttl))
            case ops.SwapPublish(key, expect, new, ttl):
                ttl_ms = check_swap(key, expect, new, ttl)
                return await self._run(backend.swap_publish_rounds(key, expect, new, ttl_ms))
            case ops.ClearPublish(key):
                return await self._run(backend.clear_publish_rounds(key))
            case ops.ReadRecord(key):
                validate_key(key)
                return await self._run(backend.job_record_rounds(key))
            case ops.CountDelivery(key, window):
                validate_key(key)
                return await self._run(backend.count_delivery_rounds(key, validate_ttl(window)))
            case ops.TakeSlot() | ops.LeaveSlot() | ops.TakeRate():
                return backend.execute(op)  # refused before any I/O: Redlock keeps neither
        raise LockError(f"the asyncio redlock store cannot run {type(op).__name__}")

    async def _grant(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        return await self._run(
            self.backend.begin_rounds(key, owner, ttl_ms, meta, record, fingerprint)
        )

    async def _commit(self, rec: CommitRecord) -> bool:
        return await self._run(self.backend.commit_rounds(rec))

    async def _run(self, flow: Rounds[T]) -> T:
        """Carry `flow`'s rounds on the loop; a cancellation is thrown into it to clean up."""
        replies: Any = None
        error: BaseException | None = None
        while not isinstance(step := advance(flow, replies, error), Done):
            replies = error = None
            try:
                replies = await self._round(step)
            except BaseException as exc:  # CancelledError too: the flow frees what it may hold
                error = exc
        return step.value

    async def _conns(self, deadline: float) -> list[_Conn | None]:
        """Each master's connection; those not connected yet are awaited until `deadline`
        (0: not at all, as for a clean-up that must not wait)."""
        if deadline:
            pending = [t for m in self.masters if (t := m.connect_task()) is not None]
            if pending:
                await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        return [m.live() for m in self.masters]

    async def _round(self, step: Round) -> dict[int, Any]:
        """As RedlockBackend._round: the payload to every target master at once, replies
        read until the round is decided or its deadline; NO_REPLY for those still silent."""
        self.backend.rounds += 1
        conns = await self._conns(step.deadline)
        payload = step.payload
        replies: dict[int, Any] = {}
        pending: dict[asyncio.Future[Any], int] = {}
        for i in range(len(conns)) if step.targets is None else step.targets:
            conn = conns[i]
            future = conn.send(payload) if conn is not None else None
            if future is None:
                replies[i] = NO_REPLY
            else:
                pending[future] = i
        reloaded: set[int] = set()
        while pending and not step.decided(replies, len(pending)):
            left = step.deadline - time.monotonic()
            if left <= 0:
                break
            done, _ = await asyncio.wait(pending, timeout=left,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            for future in done:
                i = pending.pop(future)
                value = future.result()
                conn = conns[i]
                if is_noscript(value) and i not in reloaded and conn is not None:
                    # The master lost its scripts: load them and resend, in order.
                    reloaded.add(i)
                    loads = self.masters[i].master.script_loads()
                    again = conn.send(b"".join([*loads, payload]), dropped=len(loads))
                    if again is not None:
                        pending[again] = i
                        continue
                replies[i] = value
        for i in pending.values():
            replies[i] = NO_REPLY
        return replies

    async def _wait(self, key: str, timeout: float) -> None:
        """BLPOP the key's signal on one master, as RedlockBackend.wait_for_release; if
        that master fails, the next one is used from the next wait on, and this one sleeps."""
        index = self.backend.wait_master(key)
        try:
            await self._signals.wait(self.masters[index].client, self.keys.signal(key), timeout)
        except RedisError:
            self._wait_on = index + 1
            await asyncio.sleep(min(timeout, self._signals.max_block))

    def security(self) -> Security:
        """The sync backend's: the same masters, URLs and TLS."""
        return self.backend.security()

    async def aclose(self) -> None:
        """Wait briefly for the replies still owed (so what was sent has run), then close."""
        conns = [c for m in self.masters if (c := m.live()) is not None and c.owed]
        owed = [f for c in conns if (f := c.send(_pack("PING"))) is not None]
        if owed:
            await asyncio.wait(owed, timeout=min(self.backend.socket_timeout, 1.0))
        for master in self.masters:
            await master.aclose()
        await asyncio.to_thread(self.backend.close)
