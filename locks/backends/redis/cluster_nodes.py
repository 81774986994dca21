"""A Redis Cluster's client options, nodes and slots, shared by the sync and asyncio stores:
each node's address judged, a hash tag per slot, the heartbeat's grouping per node."""

from __future__ import annotations

import binascii
import functools
import itertools
import string
from collections.abc import Callable, Sequence
from typing import Any

from redis.cluster import RedisCluster
from redis.connection import SSLConnection
from redis.exceptions import RedisClusterException, RedisError

from jobfence.config.security import refuse_node
from jobfence.config.urls import cluster_target
from jobfence.locks.backend import Security
from jobfence.locks.backends.redis.semaphores import semaphore_keys
from jobfence.locks.backends.redis.url import security_of_kwargs, tls_kwargs
from jobfence.locks.keys import KeySpace

EXTEND_SCRIPT = "cluster_extend_many"
SLOTS = 16384


def cluster_security(kwargs: Any) -> Security:
    """TLS and login of every node's connections, from the cluster client's options."""
    tls = bool(kwargs.get("ssl")) or issubclass(kwargs.get("connection_class", object),
                                                SSLConnection)  # fmt: skip
    return security_of_kwargs(kwargs, tls)


class JudgedCluster(RedisCluster):
    """A cluster client that judges each node's address (every node CLUSTER SLOTS names, at
    start and as the map changes) before it logs in there: seeds on loopback say nothing of
    where the nodes they name are."""

    def __init__(self, **kwargs: Any) -> None:
        self.node_security = cluster_security(kwargs)  # on_connect runs within __init__
        super().__init__(**kwargs)

    def on_connect(self, connection: Any) -> None:
        refuse_node(self.node_security, (str(connection.host), int(connection.port)),
                    "cluster node")  # fmt: skip
        super().on_connect(connection)  # type: ignore[no-untyped-call]


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
