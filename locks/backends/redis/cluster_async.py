"""The asyncio store on a Redis Cluster: redis.asyncio's cluster client, the sync backend's Lua."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Self, TypeVar

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from jobfence.config.security import refuse_node
from jobfence.locks.backend import Capabilities, settle_extensions, validate_ttl
from jobfence.locks.backends.redis.async_store import AsyncRedisStore
from jobfence.locks.backends.redis.backend import RedisBackend
from jobfence.locks.backends.redis.cluster import RedisClusterBackend
from jobfence.locks.backends.redis.cluster_nodes import (
    cluster_options,
    cluster_security,
    extend_args,
    group_by_node,
)
from jobfence.locks.backends.redis.protocol import EXTEND_CHUNK
from jobfence.locks.backends.redis.scripts import script_source
from jobfence.locks.backends.redis.semaphores import SEMAPHORE_SCRIPTS, sem_extend_call
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import Lease
from jobfence.locks.slots import SlotLease

_Node: Any = ClusterNode  # redis-py leaves it untyped
T = TypeVar("T")
KEEPER_MARGIN = 4


class _JudgedAsyncCluster(RedisCluster):  # type: ignore[misc]
    """redis.asyncio's cluster client judging each node's address (every node CLUSTER SLOTS
    names) before it logs in there, as the sync twin's (redis.cluster_nodes.JudgedCluster)."""

    def __init__(self, **kwargs: Any) -> None:
        self.node_security = cluster_security(kwargs)
        super().__init__(**kwargs)
        # Every node connection runs this in place of its own on_connect (the login): in
        # the template of the nodes found from now on, and in the seeds made already (their
        # connections open lazily, so this is before any login).
        judged = {"redis_connect_func": self._judged_connect}
        self.nodes_manager.connection_kwargs.update(judged)
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_kwargs.update(judged)

    async def _judged_connect(self, connection: Any) -> None:
        refuse_node(self.node_security, (str(connection.host), int(connection.port)),
                    "cluster node")  # fmt: skip
        await connection.on_connect()


class AsyncClusterStore(AsyncRedisStore):
    """Locks on a Redis Cluster for asyncio: each op is the one-node script on its key's
    slot, routed by redis.asyncio's cluster client (MOVED/ASK followed, a timeout never
    re-sent), with RedisClusterBackend's keys and per-slot fence sources, so sync and async
    holders share one fence space. An Extend sends one script to each node that serves a
    held lease, all nodes at once: a node that fails leaves only its own leases unknown."""

    name: ClassVar[str] = "redis-cluster"
    capabilities: ClassVar[Capabilities] = RedisClusterBackend.capabilities
    sync_class: ClassVar[type[RedisBackend]] = RedisClusterBackend

    backend: RedisClusterBackend
    client: Any  # a RedisCluster: redis-py leaves it largely untyped

    @classmethod
    def _connect(
        cls, url: str, backend: RedisBackend, socket_timeout: float, max_connections: int
    ) -> Self:
        assert isinstance(backend, RedisClusterBackend)
        client = _JudgedAsyncCluster(
            **cluster_options(url, socket_timeout, _Node),
            retry=Retry(NoBackoff(), 0),  # per node: a waiter holds one connection
            # Past its cap a node refuses (MaxConnectionsError) instead of waiting: ops
            # queue on `_slots` below; the margin is the keeper's, one per node and batch.
            max_connections=max_connections + KEEPER_MARGIN,
        )
        cluster: Any = client  # not a redis.asyncio.Redis, but it answers the same commands
        return cls(backend, cluster, max_connections=max_connections, socket_timeout=socket_timeout)

    def __init__(self, *args: Any, max_connections: int = 32, **kwargs: Any) -> None:
        super().__init__(*args, max_connections=max_connections, **kwargs)
        # At most max_connections ops at once, so no node is asked for more connections.
        self._slots = asyncio.Semaphore(max_connections)

    async def _call(
        self, name: str, keys: list[str], args: list[Any], key: str | None,
        client: Any = None,
    ) -> Any:  # fmt: skip
        try:
            if not self._loaded:
                await self._load_all()
            async with self._slots:
                return await super()._call(name, keys, args, key, client)
        except RedisClusterException as exc:  # no node for the slot (cluster down), say
            raise BackendUnavailable(f"redis cluster {name} failed", key=key, cause=exc) from exc

    async def _command(self, what: str, key: str, call: Callable[[Any], Awaitable[T]]) -> T:
        try:
            async with self._slots:
                return await super()._command(what, key, call)
        except RedisClusterException as exc:  # no node for the slot (cluster down), say
            raise BackendUnavailable(f"redis cluster {what} failed", key=key, cause=exc) from exc

    async def _load_script(self, client: Any, source: str) -> str:
        # Once at a time: SCRIPT LOAD goes to every primary, and many at once (every
        # coroutine's first call after a restart) broke the cluster client's connections.
        if self._loading is None:
            self._loading = asyncio.Lock()
        async with self._loading:
            return await super()._load_script(client, source)

    _loading: asyncio.Lock | None = None
    _loaded = False

    async def _load_all(self) -> None:
        """Every script on every primary before the first call: else each coroutine's first
        call meets NOSCRIPT, and their SCRIPT LOADs at once broke the client's connections."""
        if self._loading is None:
            self._loading = asyncio.Lock()
        async with self._loading:
            if self._loaded:
                return
            scripts = self.backend.scripts
            for extra in SEMAPHORE_SCRIPTS:
                if extra not in scripts:
                    scripts[extra] = self.backend.client.register_script(script_source(extra))
            for script in list(scripts.values()):
                script.sha = await self.client.script_load(script.script)
            self._loaded = True

    async def _wait(self, key: str, timeout: float) -> None:
        try:
            async with self._slots:
                await super()._wait(key, timeout)
        except RedisClusterException as exc:
            raise BackendUnavailable("redis cluster wait failed", key=key, cause=exc) from exc

    async def _extend(self, leases: list[Lease]) -> list[bool]:
        """As RedisClusterBackend.extend_many: the leases of a node that did not answer stay
        unknown (the others are renewed or marked lost first), then BackendUnavailable."""
        if not leases:
            return []
        if not self._loaded:  # also reads the slot map: a first call may be an extension
            await self._load_all()
        started = self.clock.monotonic()
        items = [(le.key, le.owner, validate_ttl(le.ttl)) for le in leases]
        slots = [type(le) is SlotLease for le in leases]
        groups, retry = group_by_node(self.keys, items, slots, self.client.keyslot,
                                      self.client.nodes_manager.get_node_from_slot)  # fmt: skip
        results: list[bool | None] = [None] * len(items)
        replies = await asyncio.gather(
            *(self._extend_on(node, indexes, items, slots) for node, indexes in groups.values()),
            return_exceptions=True,
        )
        failure = await self._node_answers(groups, replies, results, retry)
        moved = await self._extend_moved(sorted(retry), items, slots, results)
        failure = failure or moved
        known = [i for i, ok in enumerate(results) if ok is not None]
        settle_extensions([leases[i] for i in known], [bool(results[i]) for i in known], started)
        if failure is not None:
            raise failure
        return [bool(ok) for ok in results]

    async def _node_answers(
        self,
        groups: dict[str, tuple[Any, list[int]]],
        replies: Sequence[list[Any] | BaseException],
        results: list[bool | None],
        retry: list[int],
    ) -> BackendUnavailable | None:
        """Each node's reply into `results` (a slot that moved away into `retry`); the error
        of the first node that failed, with the map read again for each that did."""
        failure: BackendUnavailable | None = None
        for (name, (_, indexes)), reply in zip(groups.items(), replies, strict=True):
            if isinstance(reply, BaseException):
                if not isinstance(reply, RedisError | RedisClusterException):
                    raise reply
                failure = failure or BackendUnavailable(
                    f"redis cluster extend_many failed on node {name}", cause=reply
                )
                with contextlib.suppress(RedisError, RedisClusterException):
                    # Read the map again, so that the next batch finds a promoted replica.
                    await self.client.nodes_manager.initialize(last_failed_node_name=name)
                continue
            for i, answer in zip(indexes, reply, strict=True):
                if int(answer) < 0:  # the slot moved away from this node
                    retry.append(i)
                else:
                    results[i] = bool(int(answer))
        return failure

    async def _extend_moved(
        self,
        indexes: list[int],
        items: Sequence[tuple[str, str, int]],
        slots: Sequence[bool],
        results: list[bool | None],
    ) -> BackendUnavailable | None:
        """Extend the leases at `indexes` one by one through the cluster client (it follows
        MOVED/ASK); the first error, if any."""
        failure: BackendUnavailable | None = None
        for i in indexes:
            key, owner, ttl_ms = items[i]
            try:
                if slots[i]:
                    keys, args = sem_extend_call(self.keys.prefix, [items[i]],
                                                 self.backend.semaphore_retention_ms)  # fmt: skip
                    reply = await self._call("sem_extend_many", keys, args, key,
                                             self.keeper_client)  # fmt: skip
                    results[i] = bool(int(reply[0]))
                else:
                    results[i] = bool(await self._call("extend", [self.keys.lock(key)],
                                                       [owner, ttl_ms], key))  # fmt: skip
            except BackendUnavailable as exc:
                failure = failure or exc
        return failure

    async def _extend_on(
        self,
        node: Any,
        indexes: list[int],
        items: Sequence[tuple[str, str, int]],
        slots: Sequence[bool],
    ) -> list[Any]:
        """One node's answers, chunk by chunk (-1: that node did not run the chunk)."""
        backend = self.backend
        answers: list[Any] = []
        for start in range(0, len(indexes), EXTEND_CHUNK):
            chunk = indexes[start : start + EXTEND_CHUNK]
            args = extend_args(self.keys, backend.semaphore_retention_ms, chunk, items, slots)
            try:
                try:
                    reply = await node.execute_command("EVALSHA", backend.extend_sha, 0, *args)
                except NoScriptError:  # a node that never saw it (a promoted replica, a restart)
                    await node.execute_command("SCRIPT", "LOAD", backend.extend_source)
                    reply = await node.execute_command("EVALSHA", backend.extend_sha, 0, *args)
            except ResponseError:  # READONLY, CLUSTERDOWN, ...: the script did not run
                reply = [-1] * len(chunk)
            answers += list(reply)
        return answers

    async def aclose(self) -> None:
        await self.client.aclose()
        self.backend.close()
