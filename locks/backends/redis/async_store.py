"""The asyncio Redis store (one node): scripts on a pipelined lane, the rest on redis.asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Self, TypeVar, Unpack

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError

from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    NativeAsyncStore,
    RateGrant,
    Security,
    check_swap,
    default_meta,
    settle_extensions,
    validate_key,
    validate_rate,
    validate_ttl,
)
from jobfence.locks.backends.common import UrlOptions, url_options
from jobfence.locks.backends.redis.async_lane import Address, AsyncLane
from jobfence.locks.backends.redis.backend import RedisBackend
from jobfence.locks.backends.redis.protocol import (
    LEGACY_RECORD_FIELDS,
    begin_call,
    claim_call,
    client_options,
    commit_call,
    extend_calls,
    legacy_record_of,
    parse_begin,
    parse_extend,
    parse_held,
    parse_rate,
    rate_call,
    release_call,
    stored_record,
    swap_call,
)
from jobfence.locks.backends.redis.scripts import script_source
from jobfence.locks.backends.redis.semaphores import (
    SEMAPHORE_SCRIPTS,
    parse_sem_acquire,
    sem_acquire_args,
    sem_extend_call,
    sem_release_call,
    semaphore_keys,
)
from jobfence.locks.backends.redis.signal_wait import SignalWait
from jobfence.locks.backends.redis.url import tls_context, tls_kwargs, url_tls
from jobfence.locks.errors import BackendUnavailable, LockError
from jobfence.locks.lease import Lease, OwnerMeta
from jobfence.locks.ops import (
    Acquire,
    Begin,
    ClaimPublish,
    ClearPublish,
    Commit,
    CountDelivery,
    Extend,
    Inspect,
    LeaveSlot,
    ReadRecord,
    Release,
    ReleaseGrant,
    ReleaseOwner,
    StoreOp,
    SwapPublish,
    TakeRate,
    TakeSlot,
    WaitRelease,
)
from jobfence.locks.slots import SlotLease, validate_limit

#: How long an op waits for a free connection of the pool (seconds) before it fails.
POOL_WAIT = 30.0
T = TypeVar("T")


class AsyncUrlOptions(UrlOptions, total=False):
    """`UrlOptions` and the asyncio pool's size (a waiter holds a connection in BLPOP)."""

    max_connections: int  # default 32


class AsyncRedisStore(NativeAsyncStore):
    """Locks on one Redis server for asyncio: each op is one awaited EVALSHA of the same
    script the sync RedisBackend sends (or its plain command: a job record's GET, the
    delivery count's MULTI), on the same keys, so sync and async holders of one key exclude
    each other and share one fence space and one record space (Inspect, an admin read,
    runs the sync backend's in a worker thread).

    It keeps a RedisBackend on the same server (`backend`, connected only if used) for what
    the two share: the key layout, the script digests and the fence floor; its leases name
    that backend, so `lease.release()` from a thread still works.
    """

    backend: RedisBackend  # the sync twin (NativeAsyncStore)
    sync_class: ClassVar[type[RedisBackend]] = RedisBackend
    name: ClassVar[str] = "redis"
    capabilities: ClassVar[Capabilities] = RedisBackend.capabilities

    def __init__(
        self,
        backend: RedisBackend,
        client: redis.asyncio.Redis,
        keeper_client: redis.asyncio.Redis | None = None,
        *,
        max_connections: int | None = None,
        socket_timeout: float | None = None,
        lane: AsyncLane | None = None,
    ) -> None:
        self.backend = backend
        self.client = client
        # The scripts' pipelined connection (async_lane.py), where the server is one fixed
        # node; a topology that moves (Sentinel, Cluster) sends through `client`.
        self.lane = lane
        # Extensions go through a pool of their own: a storm of acquires and waiters that
        # takes every connection of `client` must not make the held leases miss renewal.
        self.keeper_client = keeper_client or client
        self.keys = backend.keys
        self.clock = backend.clock
        # A client without one pool (a cluster's) names its cap and timeout itself.
        pool = getattr(client, "connection_pool", None)
        if max_connections is None:
            max_connections = getattr(pool, "max_connections", 2) or 2
        timeout = socket_timeout
        if timeout is None and pool is not None:
            timeout = pool.connection_kwargs.get("socket_timeout")
        self._signals = SignalWait(max_connections, timeout)

    @classmethod
    def from_url(cls, url: str, **options: Unpack[AsyncUrlOptions]) -> Self:
        """The store of `url`, beside its sync twin (`sync_class`, built from the same URL);
        each Redis topology's store connects in its own `_connect`."""
        o = url_options(options)
        backend = cls.sync_class.from_url(
            url, prefix=o.prefix, socket_timeout=o.socket_timeout, clock=o.clock
        )
        return cls._connect(url, backend, o.socket_timeout, options.get("max_connections", 32))

    @classmethod
    def _connect(
        cls, url: str, backend: RedisBackend, socket_timeout: float, max_connections: int
    ) -> Self:
        """The asyncio clients of `url` (one server's), around the sync twin `backend`."""
        # The sync client's options, with redis.asyncio's own (no-)retry object. A waiter
        # holds a connection in BLPOP, so many coroutines need many: past the cap an op
        # waits for a free one rather than fail.
        options = {**client_options(socket_timeout), "retry": Retry(NoBackoff(), 0)}
        # The same ssl_ options as the sync client's (one parsing for the Redis family).
        options.update((k, v) for k, v in tls_kwargs(url_tls(url)).items() if k != "ssl")
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=POOL_WAIT, **options
        )
        keeper_pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=4, timeout=POOL_WAIT, **options
        )
        address = Address.of(pool.connection_kwargs, tls_context(url_tls(url)))
        return cls(backend, redis.asyncio.Redis(connection_pool=pool),
                   redis.asyncio.Redis(connection_pool=keeper_pool),
                   lane=AsyncLane(address, socket_timeout))  # fmt: skip

    def security(self) -> Security:
        """The sync backend's: the same URL, TLS and login."""
        return self.backend.security()

    async def _call(
        self, name: str, keys: list[str], args: list[Any], key: str | None,
        client: redis.asyncio.Redis | None = None,
    ) -> Any:  # fmt: skip
        lane = self.lane if client is None else None  # the keeper's pool stays its own
        client = client or self.client
        scripts = self.backend.scripts
        if name not in scripts:  # the semaphore scripts, registered on first use
            for extra in SEMAPHORE_SCRIPTS:
                scripts[extra] = self.backend.client.register_script(script_source(extra))
        script = scripts[name]
        try:
            if lane is not None:
                return await _lane_evalsha(lane, script, keys, args)
            try:
                return await client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:  # a server that lost its script cache (restart, flush)
                script.sha = await self._load_script(client, script.script)
                return await client.evalsha(script.sha, len(keys), *keys, *args)
        except RedisError as exc:
            raise BackendUnavailable(f"redis {name} failed", key=key, cause=exc) from exc

    async def _command(self, what: str, key: str, call: Callable[[Any], Awaitable[T]]) -> T:
        """`call(client)`: plain commands (no script), RedisError as BackendUnavailable."""
        try:
            return await call(self.client)
        except RedisError as exc:
            raise BackendUnavailable(f"redis {what} failed", key=key, cause=exc) from exc

    async def _load_script(self, client: redis.asyncio.Redis, source: str) -> str:
        """Load `source` again after a NOSCRIPT (a restart, a flush); its digest."""
        sha: str = await client.script_load(source)
        return sha

    def _floor(self, fence: int) -> None:
        if fence > self.backend.fence_floor:
            self.backend.fence_floor = fence

    async def execute_async(self, op: StoreOp) -> Any:
        """One op (locks/ops.py), one round trip; the replies are RedisBackend.execute's."""
        match op:
            # A job's two round trips first, read by attribute: cheaper than captures.
            case Begin():
                return await self.begin_op(op)
            case Commit():
                return await self.commit_op(op)
            case Acquire(key, ttl, owner, meta):
                return await self._begin(key, ttl, owner, meta, False, "")
            case WaitRelease(key, timeout):
                return await self._wait(key, timeout)
            case Extend(leases):
                return await self._extend(list(leases))
            case Release(lease):
                if lease.released:
                    return False
                try:
                    return await self._release(lease.key, lease.owner, type(lease) is SlotLease)
                finally:
                    lease._released = True
            case ReleaseOwner(key, owner):
                validate_key(key)
                return await self._release(key, owner, False)
            case TakeSlot(key, limit, ttl, owner, meta, queue_ttl):
                return await self._take_slot(key, limit, ttl, owner, meta, queue_ttl)
            case LeaveSlot(key, owner):
                validate_key(key)
                return await self._release(key, owner, True)
        return await self._execute_other(op)

    async def _execute_other(self, op: StoreOp) -> Any:
        """The ops off a lease's path, for `execute_async`: a rate limit's turn, the admin
        read, the job record and delivery count, the publish claim."""
        match op:
            case TakeRate(key, interval, burst, max_wait):
                validate_key(key)
                validate_rate(key, interval, burst)
                keys, args = rate_call(self.keys, key, interval * 1e6, burst, max_wait * 1e6)
                admitted, wait_us, now_us = parse_rate(await self._call("rate_take", keys, args,
                                                                        key))  # fmt: skip
                return RateGrant(admitted, max(0.0, wait_us / 1e6), now_us / 1e6)
            case Inspect(key):
                # An admin read, not on the hot path: the sync backend's, in a worker thread.
                return await asyncio.to_thread(self.backend.inspect, key)
            case ReleaseGrant(key, fence):  # rare too (a supersede): the same way
                return await asyncio.to_thread(self.backend.release_grant, key, fence)
            case ReadRecord(key):
                validate_key(key)
                return await self._command("job_record", key, self._read_record(key))
            case CountDelivery(key, window):
                validate_key(key)
                return await self._command("count_delivery", key,
                                           self._count(key, validate_ttl(window)))  # fmt: skip
            case ClaimPublish(key, task_id, ttl):
                validate_key(key)
                keys, args = claim_call(self.keys, key, task_id, ttl)
                return parse_held(await self._call("claim_publish", keys, args, key))
            case SwapPublish(key, expect, new, ttl):
                keys, args = swap_call(self.keys, key, expect, new,
                                       check_swap(key, expect, new, ttl))  # fmt: skip
                return parse_held(await self._call("swap_publish", keys, args, key))
            case ClearPublish(key):
                validate_key(key)
                name = self.keys.queued(key)
                await self._command("clear_publish", key, lambda client: client.delete(name))
                return None
        raise LockError(f"the asyncio redis store cannot run {type(op).__name__}")

    async def _grant(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        keys, args = begin_call(self.keys, self.backend.fence_source(key), key, owner, ttl_ms,
                                meta, record, fingerprint, self.backend.fence_floor)  # fmt: skip
        got = parse_begin(await self._call("begin", keys, args, key))
        if isinstance(got, int):
            self._floor(got)
        return got

    async def _commit(self, rec: CommitRecord) -> bool:
        return bool(await self._call("commit", *commit_call(self.keys, rec), rec.key))

    def _read_record(self, key: str) -> Callable[[Any], Awaitable[JobRecord | None]]:
        """The record read of RedisBackend.job_record: a GET, or an HMGET of a record hash
        an earlier version wrote (WRONGTYPE)."""
        name = self.keys.record(key)

        async def read(client: Any) -> JobRecord | None:
            try:
                return stored_record(await client.get(name))
            except ResponseError as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
                return legacy_record_of(await client.hmget(name, LEGACY_RECORD_FIELDS))

        return read

    def _count(self, key: str, window_ms: int) -> Callable[[Any], Awaitable[int]]:
        """RedisBackend._count_delivery's INCR and PEXPIRE, in one MULTI."""
        name = self.keys.deliveries(key)

        async def count(client: Any) -> int:
            async with client.pipeline(transaction=True) as pipe:
                pipe.incr(name)
                pipe.pexpire(name, window_ms)
                counted, _ = await pipe.execute()
            return int(counted)

        return count

    async def _wait(self, key: str, timeout: float) -> None:
        """BLPOP the key's signal list, as RedisBackend.wait_for_release (after a Busy)."""
        try:
            await self._signals.wait(self.client, self.keys.signal(key), timeout)
        except RedisError as exc:
            raise BackendUnavailable("redis wait failed", key=key, cause=exc) from exc

    async def _extend(self, leases: list[Lease]) -> list[bool]:
        if not leases:
            return []
        started = self.clock.monotonic()
        results = [False] * len(leases)
        locks = [i for i, le in enumerate(leases) if type(le) is not SlotLease]
        slots = [i for i, le in enumerate(leases) if type(le) is SlotLease]
        if locks:
            items = [(leases[i].key, leases[i].owner, validate_ttl(leases[i].ttl)) for i in locks]
            replies = [await self._call("extend_many", keys, args, None, self.keeper_client)
                       for keys, args in extend_calls(self.keys, items)]  # fmt: skip
            for i, ok in zip(locks, parse_extend(replies), strict=True):
                results[i] = ok
        if slots:
            items = [(leases[i].key, leases[i].owner, validate_ttl(leases[i].ttl)) for i in slots]
            names, args = sem_extend_call(self.keys.prefix, items,
                                          self.backend.semaphore_retention_ms)  # fmt: skip
            reply = await self._call("sem_extend_many", names, args, None, self.keeper_client)
            for i, x in zip(slots, reply, strict=True):
                results[i] = bool(int(x))
        return settle_extensions(leases, results, started)

    async def _release(self, key: str, owner: str, slot: bool) -> bool:
        if slot:
            names, args = sem_release_call(self.keys.prefix, key, owner)
            return bool(int(await self._call("sem_release", names, args, key)))
        return bool(await self._call("release", *release_call(self.keys, key, owner), key))

    async def _take_slot(
        self, key: str, limit: int, ttl: float, owner: str, meta: Any, queue_ttl: float
    ) -> Any:
        validate_key(key)
        validate_limit(limit, key)
        ttl_ms = validate_ttl(ttl)
        queue_ms = validate_ttl(queue_ttl) if queue_ttl > 0 else 0
        meta = meta or default_meta()
        started = self.clock.monotonic()
        args = sem_acquire_args(owner, limit, ttl_ms, queue_ms, meta, self.backend.fence_floor,
                                self.backend.semaphore_retention_ms)  # fmt: skip
        keys = semaphore_keys(self.keys.prefix, key)
        got = parse_sem_acquire(await self._call("sem_acquire", keys, args, key))
        if not isinstance(got, int):
            return got
        self._floor(got)
        return SlotLease(key=key, owner=owner, fence=got, ttl=ttl_ms / 1000,
                         deadline=started + ttl_ms / 1000, backend=self.backend,
                         clock=self.clock, meta=meta, limit=limit)  # fmt: skip

    async def aclose(self) -> None:
        if self.lane is not None:
            self.lane.close()
        await self.client.aclose()
        if self.keeper_client is not self.client:
            await self.keeper_client.aclose()
        self.backend.close()


async def _lane_evalsha(lane: AsyncLane, script: Any, keys: list[str], args: list[Any]) -> Any:
    """EVALSHA through the lane; after a NOSCRIPT (a restart, a flush) the script is loaded
    on the lane's own connection and sent again."""
    try:
        return await lane.call("EVALSHA", script.sha, len(keys), *keys, *args)
    except NoScriptError:
        script.sha = await lane.call("SCRIPT", "LOAD", script.script)
        return await lane.call("EVALSHA", script.sha, len(keys), *keys, *args)
