"""The ZooKeeper lock backend: an ephemeral node per lock, the session its lease, czxid fences."""

# Its parts, each a module (ZooKeeperBackend is one class built of them, bottom up):
#   url       zookeeper:// URLs: hosts, chroot, digest identity, TLS options (parse_target)
#   tls       TLSRefused and tls_problem: a TLS set-up to fix, told apart from an outage
#   session   Session: one KazooClient, the TTL the server granted, why a connection failed
#   nodes     node names, a key's paths, node data, Grant (what a grant leaves this process)
#   core      Core: options and state, the fork reset, one request (_call), one multi
#   reaper    Reaping: the thread that ends lost leases and deletes nodes made for none
#   sessions  Sessions: a session per TTL, the ACL check, the server clock, the fence base
#   prune     Pruning: expired records and markers, key nodes past the fence retention
#   grant     Granting: begin (one multi per try), Busy, stale nodes, wait_for_release
#   holding   Holding: extend, release and commit of a lock this process holds
#   records   Reading: inspect, scan, job records, the queued and deliveries markers
#   backend   ZooKeeperBackend: the parts assembled, from_url, start-up checks, close

from jobfence.locks.backends.zookeeper.backend import ZooKeeperBackend
from jobfence.locks.backends.zookeeper.core import PRUNE_INTERVAL
from jobfence.locks.backends.zookeeper.grant import ATTEMPTS, KNOWN_KEYS, STALE_MARGIN
from jobfence.locks.backends.zookeeper.holding import MAX_RECORD_BYTES
from jobfence.locks.backends.zookeeper.nodes import node_name, owner_digest
from jobfence.locks.backends.zookeeper.session import RECONNECT_CAP
from jobfence.locks.backends.zookeeper.sessions import ADMIN_TTL
from jobfence.locks.backends.zookeeper.tls import TLSRefused, tls_problem
from jobfence.locks.backends.zookeeper.url import (
    DEFAULT_PORT,
    SCHEMES,
    TLS_OPTIONS,
    Target,
    parse_target,
    parse_url,
)

__all__ = [
    "ADMIN_TTL",
    "ATTEMPTS",
    "DEFAULT_PORT",
    "KNOWN_KEYS",
    "MAX_RECORD_BYTES",
    "PRUNE_INTERVAL",
    "RECONNECT_CAP",
    "SCHEMES",
    "STALE_MARGIN",
    "TLS_OPTIONS",
    "TLSRefused",
    "Target",
    "ZooKeeperBackend",
    "node_name",
    "owner_digest",
    "parse_target",
    "parse_url",
    "tls_problem",
]
