"""Locks on a Redis Cluster: the single-node scripts, one slot each; heartbeats batched per node."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, ClassVar, Unpack

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from jobfence.config.findings import Finding, LockTarget, OutageProbe
from jobfence.config.settings import Settings
from jobfence.locks.backend import JobRecord, LockInfo, Security
from jobfence.locks.backends.common import (
    FENCE_RETENTION,
    UrlOptions,
    settings_options,
    url_options,
)
from jobfence.locks.backends.redis import checks as redis_checks
from jobfence.locks.backends.redis.backend import RedisBackend
from jobfence.locks.backends.redis.cluster_heartbeat import NodeHeartbeats
from jobfence.locks.backends.redis.cluster_nodes import (
    EXTEND_SCRIPT,
    JudgedCluster,
    cluster_options,
    cluster_security,
    slot_tags,
)
from jobfence.locks.backends.redis.lane import Lane
from jobfence.locks.backends.redis.protocol import BLPOP_LATE
from jobfence.locks.backends.redis.scripts import script_source
from jobfence.locks.backends.redis.url import tls_hint
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable

_Node: Any = ClusterNode  # redis-py leaves it untyped


class RedisClusterBackend(NodeHeartbeats, RedisBackend):
    """Locks on a Redis Cluster (7.0 or later). Build with `from_url`.

    Every script of the single-node backend touches the keys of one lock key only, and
    KeySpace wraps that key in `{...}`, so they share one hash slot (the fence source
    too: one key per slot, `fence_source`): each runs where its slot lives, with the fence
    `max(source + 1, node time in µs)` of that slot's node. redis-py's
    cluster client routes them and follows MOVED/ASK (the node did not run the command);
    it never re-sends after a timeout or a broken connection (a re-sent acquire or commit
    is not idempotent), so a node that fails mid-call, or a slot whose master is down
    before its replica takes over, raises BackendUnavailable. `extend_many` sends one
    script to each node that serves a held lock or semaphore slot, all at once, then reads
    the replies; a node that fails leaves only its own leases unknown.
    """

    name: ClassVar[str] = "redis-cluster"  # capabilities: RedisBackend's, every one
    one_slot: ClassVar[bool] = False

    def __init__(
        self,
        client: RedisCluster,
        *,
        prefix: str = "jobfence",
        fence_retention: float = FENCE_RETENTION,
        socket_timeout: float = 2.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(client, prefix=prefix, fence_retention=fence_retention,  # type: ignore[arg-type]
                         clock=clock)  # fmt: skip
        self.cluster: Any = client  # redis-py's cluster client is largely untyped
        self._lanes: dict[str, Lane] = {}  # per node name: the hot path's connections
        self._max_block = max(0.01, 0.8 * socket_timeout)
        self._late = socket_timeout + BLPOP_LATE
        self.extend_source = script_source(EXTEND_SCRIPT)
        self.extend_sha = hashlib.sha1(self.extend_source.encode()).hexdigest()
        # On every primary now, so the first heartbeat is one round trip too (a node that
        # misses it later, a promoted replica say, loads it on its first NOSCRIPT).
        with contextlib.suppress(RedisError, RedisClusterException):
            self.cluster.script_load(self.extend_source)
        self.note_replicas()

    @classmethod
    def from_url(  # type: ignore[override]
        cls, url: str, **options: Unpack[UrlOptions]
    ) -> RedisClusterBackend:
        """`redis+cluster://[user:password@]host:port[,host:port...]` (seed nodes)."""
        o = url_options(options)
        try:
            client = JudgedCluster(
                **cluster_options(url, o.socket_timeout, _Node), retry=Retry(NoBackoff(), 0)
            )
        except (RedisError, RedisClusterException) as exc:
            hint = tls_hint(exc)
            raise BackendUnavailable(
                f"no seed node of the cluster answered ({type(exc).__name__}); "
                + (hint or "check JOBFENCE_LOCK_URL lists reachable cluster nodes"), cause=exc,
            ) from exc  # fmt: skip
        return cls(client, prefix=o.prefix, fence_retention=o.fence_retention,
                   socket_timeout=o.socket_timeout, clock=o.clock)  # fmt: skip

    @classmethod
    def from_settings(
        cls, settings: Settings, *, clock: Clock = SYSTEM_CLOCK
    ) -> RedisClusterBackend:
        return cls.from_url(settings.lock_url, clock=clock, **settings_options(settings))

    def security(self) -> Security:
        """TLS and login of every node's connections, as the cluster client was built."""
        return cluster_security(self.cluster.nodes_manager.connection_kwargs)

    def fence_source(self, key: str) -> str:
        """The fence source of the slot `key` lives in: one key per slot, never per lock key."""
        return self.keys.slot_fences(slot_tags()[self.cluster.keyslot(self.keys.lock(key))])

    def note_replicas(self) -> None:
        """ha on this instance: true when the cluster has replicas to fail over to."""
        caps = replace(type(self).capabilities, ha=bool(self.cluster.get_replicas()))
        vars(self)["capabilities"] = caps

    def _evalsha(self, sha: str, keys: list[str], args: list[Any]) -> Any:
        """On the lane of the node the cluster map gives for the keys' slot; a redirect goes
        through redis-py's cluster client, which follows it and fixes its map.

        MOVED, ASK, TRYAGAIN and CLUSTERDOWN are answers from a node that did not run the
        script, so sending it again is safe. A timeout or a broken connection is not: it
        raises (BackendUnavailable, from `_call`), after the map is read again so that the
        next call finds a promoted replica.
        """
        lane = self._lane_of(keys[0])
        if lane is None:
            return self.cluster.evalsha(sha, len(keys), *keys, *args)
        try:
            return lane.call("EVALSHA", sha, len(keys), *keys, *args)
        except (AskError, TryAgainError, ClusterDownError):  # MovedError is an AskError
            return self.cluster.evalsha(sha, len(keys), *keys, *args)
        except (RedisConnectionError, RedisTimeoutError):
            with contextlib.suppress(RedisError, RedisClusterException):
                # The failed node asked last: a frozen one would hold up the map's refresh.
                self.cluster.nodes_manager.initialize(last_failed_node_name=lane.node)
            raise

    def _lane_of(self, name: str) -> Lane | None:
        """The lane of the node the cluster map gives for `name`'s slot (None: no map)."""
        try:
            node = self.cluster.nodes_manager.get_node_from_slot(self.cluster.keyslot(name))
            pool = node.redis_connection.connection_pool
        except (RedisError, RedisClusterException, AttributeError):
            return None
        lane = self._lanes.get(node.name)
        if lane is None or lane.pool is not pool:
            lane = self._lanes[node.name] = Lane(pool, node.name)
        return lane

    def _call(self, name: str, keys: list[str], args: list[Any], key: str | None) -> Any:
        try:
            return super()._call(name, keys, args, key)
        except RedisClusterException as exc:  # no node for the slot (cluster down), say
            raise BackendUnavailable(f"redis cluster {name} failed", key=key, cause=exc) from exc

    # -- the single node's admin calls, with the cluster client's own errors as unavailability
    def _inspect(self, key: str) -> LockInfo | None:
        with self._unavailable("inspect", key):
            return super()._inspect(key)

    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        with self._unavailable("scan", None):
            yield from super().scan(match)

    def job_record(self, key: str) -> JobRecord | None:
        with self._unavailable("job_record", key):
            return super().job_record(key)

    def clear_publish(self, key: str) -> None:
        with self._unavailable("clear_publish", key):
            super().clear_publish(key)

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        with self._unavailable("count_delivery", key):
            return super()._count_delivery(key, window_ms)

    def forget(self, key: str) -> bool:
        with self._unavailable("forget", key):
            return super().forget(key)

    def force_release(self, key: str) -> bool:
        with self._unavailable("force_release", key):
            return super().force_release(key)

    def wait_for_release(self, key: str, timeout: float) -> None:
        with self._unavailable("wait", key):
            super().wait_for_release(key, timeout)

    def server_time(self) -> float:
        with self._unavailable("time", None):
            seconds, micros = self.cluster.time()
        return float(seconds) + float(micros) / 1e6

    @contextlib.contextmanager
    def _unavailable(self, what: str, key: str | None) -> Iterator[None]:
        try:
            yield
        except (RedisError, RedisClusterException) as exc:
            raise BackendUnavailable(f"redis cluster {what} failed", key=key, cause=exc) from exc

    # -- heartbeats: one script per node, all nodes at once ------------------------------
    # -- servers ---------------------------------------------------------------------------
    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        # Every node, replicas too (they become masters): refuse eviction; warn when one
        # is down, the cluster state is not ok, or no replica can take over a failed master.
        for refuse, problem, fix in self.check_servers():
            yield Finding(refuse, target.setting, problem, fix)

    def outage_probe(self, target: LockTarget) -> OutageProbe | None:
        return None  # its URL is no redis:// one, and its findings never say it is down

    def check_servers(self) -> list[tuple[bool, str, str]]:
        """What about the cluster is unsafe (refuse) or weakens a guarantee (warn), per node
        (`checks.cluster_findings`): (refuse, problem, fix) triples for the start-up checks.
        Sets this instance's `capabilities.ha` (replicas exist to fail over to)."""
        return redis_checks.cluster_findings(self)

    def close(self) -> None:
        lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            lane.close()
        self.cluster.close()
