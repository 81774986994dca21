"""The one table of lock URL schemes: each lock backend's schemes and which of them asks for TLS.

Every other list of lock schemes is derived from this table: the backend registry
(locks/registry.py) registers each backend with its row, the settings checks
(config/urls/, config/security.py) and the start-up checks (worker/checks.py) read it.
It lives in config, the bottom layer, so the settings checks read it without importing
the locks package (which imports config: the other way would be a cycle).
``tests/test_lock_schemes.py`` keeps lock scheme literals out of the rest of the product code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendSchemes:
    """The URL schemes that pick one lock backend."""

    schemes: tuple[str, ...]  # the first is the one messages name
    tls: str | None = None  # the scheme (one of `schemes`) that asks for TLS, if any

    @property
    def plain(self) -> str:
        """The scheme messages name (the first)."""
        return self.schemes[0]


#: The Redis backend's scheme for a server's socket file: a path, no host to check.
UNIX_SCHEME = "unix"

#: By backend name (the registry's entry names), in registration order.
LOCK_SCHEMES: dict[str, BackendSchemes] = {
    "redis": BackendSchemes(("redis", "rediss", UNIX_SCHEME), tls="rediss"),
    "memory": BackendSchemes(("memory",)),
    "postgres": BackendSchemes(("postgresql", "postgres", "postgresql+psycopg")),
    "mysql": BackendSchemes(("mysql", "mariadb", "mysql+pymysql")),
    "redlock": BackendSchemes(("redlock", "redlocks"), tls="redlocks"),
    "etcd": BackendSchemes(("etcd", "etcds"), tls="etcds"),
    "redis-cluster": BackendSchemes(("redis+cluster", "rediss+cluster"), tls="rediss+cluster"),
    "redis-sentinel": BackendSchemes(("redis+sentinel", "rediss+sentinel"), tls="rediss+sentinel"),
    "zookeeper": BackendSchemes(("zookeeper",)),  # TLS by a query option (use_ssl=true)
}

#: The backends that speak Redis's protocol (a Redis server, or each of their nodes).
REDIS_FAMILY = ("redis", "redis-sentinel", "redis-cluster", "redlock")


def backend_schemes(name: str) -> BackendSchemes:
    """The row of backend `name`."""
    return LOCK_SCHEMES[name]


def tls_schemes() -> frozenset[str]:
    """Every lock scheme that asks for TLS."""
    return frozenset(row.tls for row in LOCK_SCHEMES.values() if row.tls)


def redis_family_schemes() -> frozenset[str]:
    """Every scheme of the Redis family's backends, TLS spellings and the socket one included."""
    return frozenset(s for name in REDIS_FAMILY for s in LOCK_SCHEMES[name].schemes)
