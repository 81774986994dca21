"""The asyncio store on a Sentinel-managed Redis: redis.asyncio's Sentinel, the sync Lua."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, ClassVar, Self

import redis.asyncio
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from jobfence.locks.backend import Capabilities
from jobfence.locks.backends.redis.async_store import POOL_WAIT, AsyncRedisStore
from jobfence.locks.backends.redis.backend import RedisBackend
from jobfence.locks.backends.redis.sentinel import (
    RedisSentinelBackend,
    sentinel_setup,
)
from jobfence.locks.backends.redis.sentinel_watch import MasterWatch
from jobfence.locks.errors import BackendUnavailable


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):  # type: ignore[misc]
    """A Sentinel pool that waits for a free connection past its cap (as the one-node
    store's) instead of failing with "Too many connections"."""


class _WatchedSentinel(Sentinel):  # type: ignore[misc]
    """redis.asyncio's Sentinel answering `discover_master` (what each new connection asks)
    with the sync twin's watch (see redis.sentinel.WatchedSentinel)."""

    watch: MasterWatch | None = None
    #: The sync twin's judge of a data node's address, before it is sent the password.
    judge: Callable[[tuple[str, int], str], None] | None = None

    async def discover_master(self, service_name: str) -> Any:
        watch = self.watch
        if watch is None:
            found = await super().discover_master(service_name)
        elif watch.address is None or watch.stale():
            found = await asyncio.to_thread(watch.master)  # asks the sentinels: off the loop
        else:
            found = watch.address
        if self.judge is not None:
            self.judge((str(found[0]), int(found[1])), "master")
        return found


class AsyncSentinelStore(AsyncRedisStore):
    """Locks on the current master of a Sentinel-managed Redis, for asyncio: the one-node
    store on a client whose pool asks the sentinels for the master at each new connection
    (see redis/sentinel.py for why that follows a failover), with the same scripts and keys
    as RedisSentinelBackend, so sync and async holders share one fence space."""

    name: ClassVar[str] = "redis-sentinel"
    capabilities: ClassVar[Capabilities] = RedisSentinelBackend.capabilities
    sync_class: ClassVar[type[RedisBackend]] = RedisSentinelBackend

    @classmethod
    def _connect(
        cls, url: str, backend: RedisBackend, socket_timeout: float, max_connections: int
    ) -> Self:
        assert isinstance(backend, RedisSentinelBackend)
        sentinel_args, service, master_args = sentinel_setup(url, socket_timeout,
                                                             Retry(NoBackoff(), 0))  # fmt: skip
        sentinel = _WatchedSentinel(**sentinel_args)  # type: ignore[no-untyped-call]
        sentinel.watch = backend.watch
        sentinel.judge = backend.judge_node

        def client(cap: int) -> redis.asyncio.Redis:
            made: redis.asyncio.Redis = sentinel.master_for(
                service, connection_pool_class=_BlockingSentinelPool,
                max_connections=cap, timeout=POOL_WAIT, **master_args,
            )  # fmt: skip
            return made

        store = cls(backend, client(max_connections), client(4))
        store.sentinel = sentinel
        return store

    sentinel: Any = None
    backend: RedisSentinelBackend
    #: The watch's epoch this store's pools were last pointed at (see _follow).
    _followed: int = 0
    _following: asyncio.Lock | None = None

    async def _call(
        self, name: str, keys: list[str], args: list[Any], key: str | None,
        client: redis.asyncio.Redis | None = None,
    ) -> Any:  # fmt: skip
        # As RedisSentinelBackend._call: sent under the watch's epoch, refused if it changed
        # before the reply; the sync twin's watch (and its lease list) serves both.
        watch = self.backend.watch
        if watch.stale():
            try:  # asks the sentinels: off the loop
                await asyncio.to_thread(watch.epoch_now)
            except RedisError as exc:
                raise BackendUnavailable(f"redis {name} failed", key=key, cause=exc) from exc
        epoch = watch.epoch
        if epoch != self._followed:
            await self._follow(epoch)
        reply = await super()._call(name, keys, args, key, client)
        watch.confirm(epoch, name, key)
        self.backend.call_epoch.value = epoch
        return reply

    async def _follow(self, epoch: int) -> None:
        """Point both pools at the master named now and close every connection they hold,
        idle or busy (redis.asyncio's pool keeps a busy one to the old master when it comes
        back); a call in flight on one fails, as it would at the epoch check."""
        if self._following is None:
            self._following = asyncio.Lock()
        async with self._following:
            if self._followed == epoch:
                return
            for client in {id(c): c for c in (self.client, self.keeper_client)}.values():
                pool: Any = client.connection_pool
                pool.master_address = self.backend.watch.address
                await pool.disconnect(inuse_connections=True)
            self._followed = epoch

    async def _load_script(self, client: redis.asyncio.Redis, source: str) -> str:
        # A NOSCRIPT may come from a demoted master (its cache went with the resync): ask
        # the sentinels now; the pool drops its idle connections only if the master moved,
        # so the script goes to the master named now. Dropping them at every NOSCRIPT tore
        # down the connections of other coroutines (every first call meets NOSCRIPT).
        pool: Any = client.connection_pool  # a _BlockingSentinelPool (from_url)
        await pool.get_master_address()
        return await super()._load_script(client, source)

    async def aclose(self) -> None:
        await super().aclose()
        if self.sentinel is not None:
            for client in self.sentinel.sentinels:
                await client.aclose()
