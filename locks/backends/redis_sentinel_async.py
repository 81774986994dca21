"""The asyncio store on a Sentinel-managed Redis: redis.asyncio's Sentinel, the sync Lua."""

from __future__ import annotations

from typing import Any, ClassVar

import redis.asyncio
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from jobfence.locks.backend import Capabilities
from jobfence.locks.backends.redis_async import POOL_WAIT, AsyncRedisStore
from jobfence.locks.backends.redis_sentinel import RedisSentinelBackend, sentinel_setup
from jobfence.locks.clock import SYSTEM_CLOCK, Clock


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):  # type: ignore[misc]
    """A Sentinel pool that waits for a free connection past its cap (as the one-node
    store's) instead of failing with "Too many connections"."""


class AsyncSentinelStore(AsyncRedisStore):
    """Locks on the current master of a Sentinel-managed Redis, for asyncio: the one-node
    store on a client whose pool asks the sentinels for the master at each new connection
    (see redis_sentinel.py for why that follows a failover), with the same scripts and keys
    as RedisSentinelBackend, so sync and async holders share one fence space."""

    name: ClassVar[str] = "redis-sentinel"
    capabilities: ClassVar[Capabilities] = RedisSentinelBackend.capabilities

    @classmethod
    def from_url(  # type: ignore[override]
        cls,
        url: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        max_connections: int = 32,
        clock: Clock = SYSTEM_CLOCK,
    ) -> AsyncSentinelStore:
        backend = RedisSentinelBackend.from_url(
            url, prefix=prefix, socket_timeout=socket_timeout, clock=clock
        )
        sentinel_args, service, master_args = sentinel_setup(url, socket_timeout,
                                                             Retry(NoBackoff(), 0))  # fmt: skip
        sentinel = Sentinel(**sentinel_args)  # type: ignore[no-untyped-call]

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
