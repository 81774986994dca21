"""The redis+cluster:// URL grammar: the seed nodes of a Redis Cluster, their login and TLS."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote

from jobfence.config.errors import UnsafeSettings
from jobfence.config.schemes import backend_schemes
from jobfence.config.urls.redis import (
    REDIS_TLS_OPTIONS,
    RedisTls,
    host_list,
    multi_host,
    redis_tls,
)

CLUSTER_EXAMPLE = "redis+cluster://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379"


@dataclass(frozen=True)
class ClusterTarget:
    """What a redis+cluster:// URL names: seed nodes, the credentials and TLS of every node."""

    nodes: list[tuple[str, int]]
    username: str | None
    password: str | None = field(repr=False)
    tls: RedisTls = field(default_factory=RedisTls)


def cluster_target(url: str, variable: str = "JOBFENCE_LOCK_URL") -> ClusterTarget:
    """Parse `redis+cluster://[user:password@]host:port[,...]` (`rediss+cluster://` and the
    ssl_ options for TLS to every node).

    The seeds are where the client first asks for the cluster's map; any one that answers
    will do, so list several. A cluster has database 0 only: no path but '/' or '/0'.
    """
    fix = f"set {variable} to a URL such as {CLUSTER_EXAMPLE}"
    scheme = backend_schemes("redis-cluster").plain
    shown, userinfo, rest, options = multi_host(url, scheme, variable, fix, REDIS_TLS_OPTIONS)
    tls = redis_tls(url, options, variable)
    hosts, _, tail = rest.partition("/")
    if tail.strip("/") not in ("", "0"):
        raise UnsafeSettings(
            variable,
            f"{shown!r} names database {tail.strip('/')!r}: a Redis Cluster has database 0 only",
            fix,
        )
    nodes = [(h.strip("[]"), p) for h, p in host_list(hosts, "node", 6379, shown, variable, fix)]
    user, colon, password = userinfo.partition(":")
    return ClusterTarget(
        list(dict.fromkeys(nodes)), unquote(user) or None, unquote(password) if colon else None,
        tls,
    )


def cluster_nodes(
    url: str, variable: str = "JOBFENCE_LOCK_URL"
) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(seed nodes, user, password) of a redis+cluster:// URL (`cluster_target`)."""
    target = cluster_target(url, variable)
    return target.nodes, target.username, target.password
