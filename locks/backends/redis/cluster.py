"""Locks on a Redis Cluster: the single-node scripts, one slot each; heartbeats batched per node."""

from __future__ import annotations

import binascii
import contextlib
import functools
import hashlib
import itertools
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import SSLConnection
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from jobfence.config.findings import Finding, LockTarget, OutageProbe
from jobfence.config.security import refuse_node
from jobfence.config.settings import Settings
from jobfence.config.urls import cluster_target
from jobfence.locks.backend import JobRecord, LockInfo, Security, validate_ttl
from jobfence.locks.backends.common import settings_options
from jobfence.locks.backends.redis.lane import Lane
from jobfence.locks.backends.redis.protocol import BLPOP_LATE, DEFAULT_FENCE_RETENTION, EXTEND_CHUNK
from jobfence.locks.backends.redis.scripts import script_source
from jobfence.locks.backends.redis.semaphore import semaphore_keys
from jobfence.locks.backends.redis.store import RedisBackend
from jobfence.locks.backends.redis.url import security_of_kwargs, tls_hint, tls_kwargs
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable, NotOwner
from jobfence.locks.keys import KeySpace
from jobfence.locks.lease import Lease
from jobfence.locks.slots import SlotLease

EXTEND_SCRIPT = "cluster_extend_many"
_Node: Any = ClusterNode  # redis-py leaves it untyped


def _cluster_security(kwargs: Any) -> Security:
    """TLS and login of every node's connections, from the cluster client's options."""
    tls = bool(kwargs.get("ssl")) or issubclass(kwargs.get("connection_class", object),
                                                SSLConnection)  # fmt: skip
    return security_of_kwargs(kwargs, tls)


class _JudgedCluster(RedisCluster):
    """A cluster client that judges each node's address (every node CLUSTER SLOTS names, at
    start and as the map changes) before it logs in there: seeds on loopback say nothing of
    where the nodes they name are."""

    def __init__(self, **kwargs: Any) -> None:
        self.node_security = _cluster_security(kwargs)  # on_connect runs within __init__
        super().__init__(**kwargs)

    def on_connect(self, connection: Any) -> None:
        refuse_node(self.node_security, (str(connection.host), int(connection.port)),
                    "cluster node")  # fmt: skip
        super().on_connect(connection)  # type: ignore[no-untyped-call]
SLOTS = 16384


def cluster_options(url: str, socket_timeout: float, node: Any) -> dict[str, Any]:
    """The cluster client's options for `url`, sync or asyncio (`node`: its ClusterNode).

    The caller adds `retry=Retry(NoBackoff(), 0)` from its own redis-py flavour: MOVED/ASK
    are followed inside one attempt; a timeout or a broken connection is not retried (the
    command may have run)."""
    target = cluster_target(url)
    return {
        "startup_nodes": [node(host, port) for host, port in target.nodes],
        "username": target.username,
        "password": target.password,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
        "decode_responses": True,
        "health_check_interval": 0,
        **tls_kwargs(target.tls),  # TLS, the same options, to every node
    }


@functools.cache
def slot_tags() -> tuple[str, ...]:
    """For each cluster slot, a short hash tag (1 to 3 letters or digits) that maps to it.

    A slot's fence source must sit in the slot of the keys it fences (a script touches one
    slot). Trying the shortest tags in turn (binascii.crc_hqx is Redis's CRC16) finds all
    16384 in about 40 ms, once per process, and keeps them printable.
    """
    alphabet = (string.digits + string.ascii_letters).encode()
    tags: list[str | None] = [None] * SLOTS
    left = SLOTS
    for length in (1, 2, 3):
        for combo in itertools.product(alphabet, repeat=length):
            slot = binascii.crc_hqx(bytes(combo), 0) % SLOTS
            if tags[slot] is None:
                tags[slot] = bytes(combo).decode()
                left -= 1
                if not left:
                    return tuple(t for t in tags if t is not None)
    raise AssertionError("three characters give every slot a tag")  # pragma: no cover


# -- the heartbeat's grouping and script arguments, shared with the asyncio store
# (locks/backends/redis/cluster_async.py): one protocol, two transports.
def lease_slot(keys: KeySpace, key: str, slot: bool, keyslot: Callable[[str], int]) -> int:
    """The cluster slot a lease (`slot`: a semaphore slot, else a lock) lives in."""
    return keyslot(semaphore_keys(keys.prefix, key)[0] if slot else keys.lock(key))


def group_by_node(
    keys: KeySpace,
    items: Sequence[tuple[str, str, int]],
    slots: Sequence[bool],
    keyslot: Callable[[str], int],
    node_of_slot: Callable[[int], Any],
) -> tuple[dict[str, tuple[Any, list[int]]], list[int]]:
    """The indexes of `items` per node name (with its node), and those no node serves now
    (to send one by one through the client, which finds the slot's node)."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    unrouted: list[int] = []
    for i, (key, _, _) in enumerate(items):
        try:
            node = node_of_slot(lease_slot(keys, key, slots[i], keyslot))
        except (RedisClusterException, RedisError, KeyError):  # KeyError: not in the map yet
            node = None
        if node is None:
            unrouted.append(i)
        else:
            groups.setdefault(node.name, (node, []))[1].append(i)
    return groups, unrouted


def extend_args(
    keys: KeySpace,
    retention_ms: int,
    indexes: Sequence[int],
    items: Sequence[tuple[str, str, int]],
    slots: Sequence[bool],
) -> list[Any]:
    """cluster_extend_many.lua's arguments (no keys) for the items at `indexes`."""
    args: list[Any] = [retention_ms]
    for i in indexes:
        key, owner, ttl_ms = items[i]
        if slots[i]:
            args += ("S", *semaphore_keys(keys.prefix, key), owner, ttl_ms)
        else:
            args += ("L", keys.lock(key), owner, ttl_ms)
    return args


class RedisClusterBackend(RedisBackend):
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
        fence_retention: float = DEFAULT_FENCE_RETENTION,
        socket_timeout: float = 2.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(client, prefix=prefix, fence_retention=fence_retention,  # type: ignore[arg-type]
                         clock=clock)  # fmt: skip
        self.cluster: Any = client  # redis-py's cluster client is largely untyped
        self._lanes: dict[str, Lane] = {}  # per node name: the hot path's connections
        self._max_block = max(0.01, 0.8 * socket_timeout)
        self._late = socket_timeout + BLPOP_LATE
        self._extend_source = script_source(EXTEND_SCRIPT)
        self._extend_sha = hashlib.sha1(self._extend_source.encode()).hexdigest()
        # On every primary now, so the first heartbeat is one round trip too (a node that
        # misses it later, a promoted replica say, loads it on its first NOSCRIPT).
        with contextlib.suppress(RedisError, RedisClusterException):
            self.cluster.script_load(self._extend_source)
        self._note_replicas()

    @classmethod
    def from_url(  # type: ignore[override]
        cls,
        url: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = DEFAULT_FENCE_RETENTION,
        clock: Clock = SYSTEM_CLOCK,
    ) -> RedisClusterBackend:
        """`redis+cluster://[user:password@]host:port[,host:port...]` (seed nodes)."""
        try:
            client = _JudgedCluster(
                **cluster_options(url, socket_timeout, _Node), retry=Retry(NoBackoff(), 0)
            )
        except (RedisError, RedisClusterException) as exc:
            hint = tls_hint(exc)
            raise BackendUnavailable(
                f"no seed node of the cluster answered ({type(exc).__name__}); "
                + (hint or "check JOBFENCE_LOCK_URL lists reachable cluster nodes"), cause=exc,
            ) from exc  # fmt: skip
        return cls(client, prefix=prefix, fence_retention=fence_retention,
                   socket_timeout=socket_timeout, clock=clock)  # fmt: skip

    @classmethod
    def from_settings(
        cls, settings: Settings, *, clock: Clock = SYSTEM_CLOCK
    ) -> RedisClusterBackend:
        return cls.from_url(settings.lock_url, clock=clock, **settings_options(settings))

    def security(self) -> Security:
        """TLS and login of every node's connections, as the cluster client was built."""
        return _cluster_security(self.cluster.nodes_manager.connection_kwargs)

    def fence_source(self, key: str) -> str:
        """The fence source of the slot `key` lives in: one key per slot, never per lock key."""
        return self.keys.slot_fences(slot_tags()[self.cluster.keyslot(self.keys.lock(key))])

    def _note_replicas(self) -> None:
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
    def extend_many(self, leases: Sequence[Lease]) -> list[bool]:
        """As the base, but a node that did not answer leaves only its own leases unknown:
        the others are renewed or marked lost first, then BackendUnavailable is raised (the
        keeper retries the batch soon). Semaphore slots go in their node's script too, so
        a hung master delays neither another's locks nor its slots."""
        if not leases:
            return []
        started = self.clock.monotonic()
        items = [(le.key, le.owner, validate_ttl(le.ttl)) for le in leases]
        results, failure = self._extend_per_node(items, [type(le) is SlotLease for le in leases])
        for lease, ok in zip(leases, results, strict=True):
            if ok is True:
                lease.renewed(started)
            elif ok is False:
                lease.mark_lost(
                    NotOwner("extend refused: not the owner", key=lease.key, fence=lease.fence)
                )
        if failure is not None:
            raise failure
        return [bool(ok) for ok in results]

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        results, failure = self._extend_per_node(items, [False] * len(items))
        if failure is not None:
            raise failure
        return [bool(ok) for ok in results]

    def _sem_extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        results, failure = self._extend_per_node(items, [True] * len(items))
        if failure is not None:
            raise failure
        return [bool(ok) for ok in results]

    def _extend_per_node(
        self, items: Sequence[tuple[str, str, int]], slots: Sequence[bool]
    ) -> tuple[list[bool | None], BackendUnavailable | None]:
        """Each lease's answer (None: unknown), and the error that left some unknown.
        `slots[i]`: item i is a semaphore slot, not a lock."""
        groups, retry = group_by_node(self.keys, items, slots, self.cluster.keyslot,
                                      self.cluster.nodes_manager.get_node_from_slot)  # fmt: skip
        results: list[bool | None] = [None] * len(items)
        sent: list[tuple[Any, Any, Any, list[list[int]]]] = []
        # A node that failed (refused, timed out): its leases stay unknown this batch, and
        # are not sent again one by one, which would cost a timeout each on a hung node.
        failed: list[tuple[str, BaseException]] = []
        for node, indexes in groups.values():
            # Scripts of EXTEND_CHUNK leases, all in one write: one round trip per node, and
            # the node serves other clients between the scripts.
            chunks = [indexes[i : i + EXTEND_CHUNK] for i in range(0, len(indexes), EXTEND_CHUNK)]
            try:
                pool = self.cluster.get_redis_connection(node).connection_pool
                conn = pool.get_connection()
            except (RedisError, RedisClusterException) as exc:
                failed.append((node.name, exc))
                continue
            try:
                conn.send_packed_command(
                    conn.pack_commands([self._extend_command(c, items, slots) for c in chunks])
                )
            except RedisError as exc:
                conn.disconnect()  # type: ignore[no-untyped-call]
                pool.release(conn)
                failed.append((node.name, exc))
                continue
            sent.append((node, pool, conn, chunks))
        for node, pool, conn, chunks in sent:  # every node works on its batch meanwhile
            try:
                replies = self._read_extend(conn, chunks, items, slots)
            except RedisError as exc:
                conn.disconnect()  # type: ignore[no-untyped-call]
                failed.append((node.name, exc))
                continue
            finally:
                pool.release(conn)
            for chunk, reply in zip(chunks, replies, strict=True):
                for i, answer in zip(chunk, reply, strict=True):
                    if int(answer) < 0:  # the slot moved away from this node
                        retry.append(i)
                    else:
                        results[i] = bool(int(answer))
        failure: BackendUnavailable | None = None
        for name, cause in failed:
            failure = failure or BackendUnavailable(
                f"redis cluster extend_many failed on node {name}", cause=cause
            )
            with contextlib.suppress(RedisError, RedisClusterException):
                # Read the map again (the failed node asked last), so that the next batch
                # finds a replica promoted in its place.
                self.cluster.nodes_manager.initialize(last_failed_node_name=name)
        for i in sorted(retry):  # through the cluster client: it follows MOVED/ASK
            key, owner, ttl_ms = items[i]
            try:
                if slots[i]:
                    args = [self.semaphore_retention_ms, owner, ttl_ms]
                    reply = self._sem_script("sem_extend_many", self._sem_keys(key), args, key)
                    results[i] = bool(int(reply[0]))
                else:
                    results[i] = bool(
                        self._call("extend", [self.keys.lock(key)], [owner, ttl_ms], key)
                    )
            except BackendUnavailable as exc:
                failure = failure or exc
        return results, failure

    def _extend_command(
        self, indexes: list[int], items: Sequence[tuple[str, str, int]], slots: Sequence[bool]
    ) -> tuple[Any, ...]:
        args = extend_args(self.keys, self.semaphore_retention_ms, indexes, items, slots)
        return ("EVALSHA", self._extend_sha, 0, *args)

    def _read_extend(
        self,
        conn: Any,
        chunks: list[list[int]],
        items: Sequence[tuple[str, str, int]],
        slots: Sequence[bool],
    ) -> list[list[Any]]:
        """The reply to each chunk's script, read in order (every reply, so the connection
        stays clean); -1 for each lock of a script the node refused to run."""
        replies: list[list[Any] | None] = []
        for chunk in chunks:
            try:
                replies.append(list(conn.read_response()))
            except NoScriptError:
                replies.append(None)
            except ResponseError:
                # READONLY (a demoted master), CLUSTERDOWN, ...: the script did not run.
                replies.append([-1] * len(chunk))
        again = [k for k, reply in enumerate(replies) if reply is None]
        if again:
            # A node that never saw the script (a replica promoted since, a restart): load
            # it there and send those again; they did not run.
            conn.send_command("SCRIPT", "LOAD", self._extend_source)
            conn.read_response()
            conn.send_packed_command(
                conn.pack_commands([self._extend_command(chunks[k], items, slots) for k in again])
            )
            for k in again:
                try:
                    replies[k] = list(conn.read_response())
                except ResponseError:
                    replies[k] = [-1] * len(chunks[k])
        return [reply if reply is not None else [] for reply in replies]

    # -- servers ---------------------------------------------------------------------------
    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        # Every node, replicas too (they become masters): refuse eviction; warn when one
        # is down, the cluster state is not ok, or no replica can take over a failed master.
        for refuse, problem, fix in self.check_servers():
            yield Finding(refuse, target.setting, problem, fix)

    def outage_probe(self, target: LockTarget) -> OutageProbe | None:
        return None  # its URL is no redis:// one, and its findings never say it is down

    def check_servers(self) -> list[tuple[bool, str, str]]:
        """What about the cluster is unsafe (refuse) or weakens a guarantee (warn), per node.

        Returns (refuse, problem, fix) triples for the start-up checks, and sets this
        instance's `capabilities.ha` (replicas exist to fail over to).
        """
        found: list[tuple[bool, str, str]] = []
        try:
            self.cluster.nodes_manager.initialize()
        except (RedisError, RedisClusterException) as exc:
            hint = tls_hint(exc)
            if hint:  # TLS or a login that cannot work: waiting never helps
                return [(True, f"the cluster cannot be used ({type(exc).__name__})", hint)]
            return [(False, f"the cluster does not answer ({type(exc).__name__}: {exc}); "
                     "starting anyway: jobs wait and are redelivered until it does",
                     "start the cluster, or fix the URL if it is wrong")]  # fmt: skip
        for node in self.cluster.get_nodes():
            client: Any = self.cluster.get_redis_connection(node)
            try:
                policy = client.config_get("maxmemory-policy").get("maxmemory-policy", "")
                state = str(client.execute_command("CLUSTER", "INFO"))
            except ResponseError as exc:
                found.append((False, f"cannot read the settings of cluster node {node.name} "
                              f"({exc}; CONFIG is disabled or not permitted): its eviction "
                              "policy is unchecked",
                              "make sure every node runs with maxmemory-policy noeviction"))
                continue  # fmt: skip
            except RedisError as exc:
                found.append((False, f"cluster node {node.name} does not answer "
                              f"({type(exc).__name__}); the slots it serves wait for a "
                              "failover", "start it, or fix the URL if it is wrong"))
                continue  # fmt: skip
            if policy != "noeviction":
                found.append((True, f"cluster node {node.name} ({node.server_type}) has "
                              f"maxmemory-policy {policy!r}: under memory pressure it may "
                              "evict lock, fence and job-record keys",
                              "run every node, replicas too (they become masters), with "
                              "--maxmemory-policy noeviction"))  # fmt: skip
            if "cluster_state:ok" not in state:
                found.append((False, f"cluster node {node.name} reports a cluster state "
                              "other than ok: keys in uncovered slots cannot be locked",
                              "assign every slot and check CLUSTER INFO"))  # fmt: skip
        self._note_replicas()
        if not self.capabilities.ha:
            found.append((False, "the cluster has no replicas: a master that fails takes "
                          "its slots' locks down until it is back",
                          "give every master a replica (redis-cli --cluster add-node "
                          "--cluster-slave)"))  # fmt: skip
        return found

    def close(self) -> None:
        lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            lane.close()
        self.cluster.close()
