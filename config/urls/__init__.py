"""URL checks and redaction for settings: one-line errors with an example, no password shown.

One module per backend family's URL grammar; every name is importable from here.
"""

from jobfence.config.urls.check import (
    LOCK_EXAMPLE,
    UrlCheck,
    check_mysql_url,
    check_one_host,
    check_url,
)
from jobfence.config.urls.etcd import ETCD_OPTIONS, check_etcd_url
from jobfence.config.urls.lock_url import (
    LOCK_URL_CHECKS,
    accept_lock_scheme,
    check_lock_url,
    forget_lock_scheme,
)
from jobfence.config.urls.redact import (
    SECRET_QUERY,
    has_scheme,
    host_port,
    port_problem,
    redact,
    split_userinfo,
)
from jobfence.config.urls.redis import (
    REDIS_TLS_OPTIONS,
    REDIS_TLS_SCHEMES,
    RedisTls,
    check_redis_url,
    host_list,
    multi_host,
    redis_tls,
)
from jobfence.config.urls.redis_cluster import (
    CLUSTER_EXAMPLE,
    ClusterTarget,
    cluster_nodes,
    cluster_target,
)
from jobfence.config.urls.redis_sentinel import (
    SENTINEL_EXAMPLE,
    SENTINEL_OPTIONS,
    SentinelTarget,
    sentinel_target,
)
from jobfence.config.urls.redlock import REDLOCK_EXAMPLE, redlock_masters
from jobfence.config.urls.zookeeper import ZOOKEEPER_OPTIONS, check_zookeeper_url

__all__ = [
    "CLUSTER_EXAMPLE",
    "ETCD_OPTIONS",
    "LOCK_EXAMPLE",
    "LOCK_URL_CHECKS",
    "REDIS_TLS_OPTIONS",
    "REDIS_TLS_SCHEMES",
    "REDLOCK_EXAMPLE",
    "SECRET_QUERY",
    "SENTINEL_EXAMPLE",
    "SENTINEL_OPTIONS",
    "ZOOKEEPER_OPTIONS",
    "ClusterTarget",
    "RedisTls",
    "SentinelTarget",
    "UrlCheck",
    "accept_lock_scheme",
    "check_etcd_url",
    "check_lock_url",
    "check_mysql_url",
    "check_one_host",
    "check_redis_url",
    "check_url",
    "check_zookeeper_url",
    "cluster_nodes",
    "cluster_target",
    "forget_lock_scheme",
    "has_scheme",
    "host_list",
    "host_port",
    "multi_host",
    "port_problem",
    "redact",
    "redis_tls",
    "redlock_masters",
    "sentinel_target",
    "split_userinfo",
]
