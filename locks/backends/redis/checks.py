"""The start-up checks of a Redis lock server (one server, a Sentinel master and its replicas, or
every node of a Cluster).

A Redis that may evict keys is refused; a wrong password, a TLS set-up that cannot work or
another server at the URL's address is a wrong setting, refused; a server that does not
answer yet is an outage the worker waits out. The broker's check (worker/server_checks.py) uses
the same eviction and credential tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.retry import Retry

from jobfence.config.findings import LOCK_SERVER_DOWN, Finding, LockTarget, refuse, warn
from jobfence.config.schemes import backend_schemes
from jobfence.config.urls import redact
from jobfence.locks.backends.probe import foreign_fix, foreign_server
from jobfence.locks.backends.redis.url import tls_hint

if TYPE_CHECKING:  # only types: those modules import this one
    from jobfence.locks.backends.redis.backend import RedisBackend
    from jobfence.locks.backends.redis.cluster import RedisClusterBackend
    from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend, Topology

CREDENTIALS_FIX = (
    "put the right user and password in the URL (percent-encoded), or grant the user "
    "its commands in the server's ACL"
)


def credentials_refused(exc: BaseException) -> str | None:
    """Why a Redis server refused these credentials, or None if `exc` is something else."""
    text = str(exc)
    words = ("WRONGPASS", "NOAUTH", "NOPERM", "invalid password",
             "called without any password configured")  # fmt: skip
    if isinstance(exc, AuthenticationError) or any(word in text for word in words):
        what = "asks for a password the URL does not give" if (
            "NOAUTH" in text or "HELLO must be called" in text or "Authentication required" in text
        ) else "refused the credentials in the URL"
        return f"{what} ({type(exc).__name__}): wrong credentials, not an outage"
    return None


def _policy(client: redis.Redis) -> str:
    reply = client.config_get("maxmemory-policy")
    value = reply.get("maxmemory-policy", "")
    return value.decode() if isinstance(value, bytes) else str(value)


def check_eviction(client: redis.Redis, what: str, setting: str, url: str) -> Iterator[Finding]:
    """Refuse a Redis that may evict keys; warn if CONFIG is disabled (cannot tell)."""
    try:
        policy = _policy(client)
    except ResponseError as exc:
        yield warn(
            setting,
            f"cannot read maxmemory-policy of the {what} at {redact(url)} ({exc}; CONFIG is "
            "disabled or not permitted), so eviction of lock and fence keys is not ruled out",
            "make sure the server runs with maxmemory-policy noeviction",
        )
        return
    if policy != "noeviction":
        yield refuse(
            setting,
            f"the {what} at {redact(url)} has maxmemory-policy {policy!r}: under memory "
            "pressure it may evict lock, fence and job-record keys, and then two holders or "
            "a repeated effect follow",
            "run redis-server with --maxmemory-policy noeviction "
            "(CONFIG SET maxmemory-policy noeviction, and in redis.conf)",
        )


def server_findings(backend: RedisBackend, target: LockTarget) -> Iterator[Finding]:
    """One Redis server: it answers, with credentials that work, and cannot evict keys; one
    that does not answer yet is waited for (LOCK_SERVER_DOWN), never a crash loop."""
    setting, url = target.setting, target.url
    try:
        backend.client.ping()
    except RedisError as exc:
        wrong = credentials_refused(exc)
        if wrong:  # a wrong password is a wrong setting, not an outage: waiting never helps
            yield refuse(setting, f"the lock server at {redact(url)} {wrong}", CREDENTIALS_FIX)
            return
        tls = urlsplit(url).scheme == backend_schemes("redis").tls
        hint = tls_hint(exc) if tls else None
        if hint:  # a TLS set-up that cannot work: no amount of waiting helps
            yield refuse(setting, f"cannot reach the lock server at {redact(url)}: {exc}", hint)
            return
        foreign = _foreign_lock_server(url, target.socket_timeout)
        if foreign:  # it answers, as something else: a wrong URL, not an outage
            yield refuse(setting, f"{redact(url)} answers, but as {foreign}, "
                         f"not a Redis server ({type(exc).__name__}: {exc})",
                         foreign_fix(foreign, setting))  # fmt: skip
            return
        # Not a refusal: a fleet restarted during a lock-server outage must come up and
        # wait, not crash-loop. Jobs delivered meanwhile are redelivered until it answers.
        yield Finding(
            False,
            setting,
            f"cannot reach the lock server at {redact(url)} at start-up "
            f"({type(exc).__name__}: {exc}); starting anyway: jobs wait and are redelivered "
            "until it answers, and its eviction policy is checked when it does",
            "start the lock server, or fix the URL if it is wrong",
            code=LOCK_SERVER_DOWN,
        )
        return
    yield from check_eviction(backend.client, "lock server", setting, url)


def _foreign_lock_server(url: str, timeout: float) -> str | None:
    """What other server answers at a plain redis:// URL's address, if one positively does."""
    parts = urlsplit(url)
    if parts.scheme != backend_schemes("redis").plain or not parts.hostname:
        return None
    return foreign_server(parts.hostname, parts.port or 6379, timeout)


class ServerProbe:
    """A Redis server down at start-up, on a client of its own: does it answer now, and
    then may it evict keys (the worker can no longer be refused: its findings are logged)."""

    def __init__(self, target: LockTarget) -> None:
        self.target = target
        self.client = redis.Redis.from_url(
            target.url,
            socket_timeout=target.socket_timeout,
            socket_connect_timeout=target.socket_timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def answers(self) -> bool:
        try:
            self.client.ping()
        except RedisError:
            return False
        return True

    def findings(self) -> Iterator[Finding]:
        return check_eviction(self.client, "lock server", self.target.setting, self.target.url)

    def close(self) -> None:
        self.client.close()


def sentinel_findings(backend: RedisSentinelBackend, target: LockTarget) -> Iterator[Finding]:
    """The master the sentinels name, as a single lock server, and each replica (one is
    promoted on failover, with its own policy); warn of a master with no replica to fail
    over to, or fewer than 3 sentinels (a quorum that survives the loss of one)."""
    setting, url = target.setting, target.url
    topo = backend.topology()
    if topo.master is None and topo.hint:  # TLS or a login that cannot work: no outage
        yield refuse(setting, f"the sentinels of {redact(url)} cannot be used: "
                     f"{topo.error}", topo.hint)  # fmt: skip
        return
    if topo.master is None:
        # As for one server: come up and wait rather than crash-loop during an outage.
        yield warn(
            setting,
            f"the sentinels of {redact(url)} name no master for {backend.service!r} at "
            f"start-up ({topo.error}); starting anyway: jobs wait and are redelivered until "
            "one answers, and its eviction policy is unchecked",
            "start the sentinels and the master, or fix the URL (sentinel addresses and the "
            "master's name as in 'sentinel monitor <name>') if it is wrong",
        )
        return
    try:
        yield from check_eviction(backend.client, "Sentinel master", setting, url)
    except RedisError as exc:
        hint = tls_hint(exc)
        if hint:  # the sentinels answer, the master's TLS or login cannot work
            yield refuse(setting, f"the Sentinel master of {redact(url)} cannot be used "
                         f"({exc})", hint)  # fmt: skip
            return
        yield warn(setting, f"the Sentinel master of {redact(url)} does not answer ({exc}); "
                   "its eviction policy is unchecked",
                   "make sure it runs with maxmemory-policy noeviction")  # fmt: skip
    yield from _replica_findings(backend, topo, setting, url)


def _replica_findings(
    backend: RedisSentinelBackend, topo: Topology, setting: str, url: str
) -> Iterator[Finding]:
    """The Sentinel master's replicas (each may be promoted, with its own eviction policy),
    and whether a failover can happen: a replica to promote, 3 sentinels for a quorum."""
    for address in topo.replicas:
        client = backend.node_client(address)
        where = f"{address[0]}:{address[1]}"
        try:
            what = f"replica {where} (promoted on failover)"
            yield from check_eviction(client, what, setting, url)
        except RedisError as exc:
            yield warn(
                setting,
                f"replica {where} of {redact(url)} does not answer ({exc}); its eviction "
                "policy is unchecked",
                "make sure every replica runs with maxmemory-policy noeviction",
            )
        finally:
            client.close()
    if not topo.replicas:
        yield warn(
            setting,
            f"the Sentinel master of {redact(url)} has no live replica: if it fails there is "
            "nothing to promote, and locks wait for it to come back",
            "run at least one replica (two, so one survives a failover)",
        )
    if topo.sentinels < 3:
        yield warn(
            setting,
            f"only {topo.sentinels} sentinel(s) watch {backend.service!r}: fewer than 3 "
            "cannot keep a majority through the loss of one, so a failover may never happen",
            "run at least 3 sentinels on separate hosts",
        )


def cluster_findings(backend: RedisClusterBackend) -> list[tuple[bool, str, str]]:
    """What about a cluster is unsafe (refuse) or weakens a guarantee (warn), as (refuse,
    problem, fix) triples: a node that may evict (replicas too: they become masters) is
    refused; a node down, a cluster state other than ok, or no replica to take over a
    failed master is warned of. Sets the backend's `capabilities.ha`."""
    cluster = backend.cluster
    try:
        cluster.nodes_manager.initialize()
    except (RedisError, RedisClusterException) as exc:
        hint = tls_hint(exc)
        if hint:  # TLS or a login that cannot work: waiting never helps
            return [(True, f"the cluster cannot be used ({type(exc).__name__})", hint)]
        return [(False, f"the cluster does not answer ({type(exc).__name__}: {exc}); "
                 "starting anyway: jobs wait and are redelivered until it does",
                 "start the cluster, or fix the URL if it is wrong")]  # fmt: skip
    found = [f for node in cluster.get_nodes() for f in _cluster_node_findings(cluster, node)]
    backend.note_replicas()
    if not backend.capabilities.ha:
        found.append((False, "the cluster has no replicas: a master that fails takes "
                      "its slots' locks down until it is back",
                      "give every master a replica (redis-cli --cluster add-node "
                      "--cluster-slave)"))  # fmt: skip
    return found


def _cluster_node_findings(cluster: Any, node: Any) -> list[tuple[bool, str, str]]:
    """One cluster node's eviction policy and its view of the cluster's state."""
    client: Any = cluster.get_redis_connection(node)
    try:
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy", "")
        state = str(client.execute_command("CLUSTER", "INFO"))
    except ResponseError as exc:
        return [(False, f"cannot read the settings of cluster node {node.name} "
                 f"({exc}; CONFIG is disabled or not permitted): its eviction "
                 "policy is unchecked",
                 "make sure every node runs with maxmemory-policy noeviction")]  # fmt: skip
    except RedisError as exc:
        return [(False, f"cluster node {node.name} does not answer "
                 f"({type(exc).__name__}); the slots it serves wait for a "
                 "failover", "start it, or fix the URL if it is wrong")]  # fmt: skip
    found: list[tuple[bool, str, str]] = []
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
    return found
