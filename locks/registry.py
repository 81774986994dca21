"""The one registry of lock backends: URL scheme → module, class, extra, URL check, capabilities.

Each built-in backend's schemes are its row of the one schemes' table, config/schemes.py (in
config, so the settings checks read it without importing this package); every list of schemes
(settings checks, `open_backend`, refusals naming the backends that can) is read from there or
here. A backend's module is imported only when its scheme is asked for, with an install hint
when its extra is missing (as dramatiq's `rate_limits/backends/__init__.py`). Adding a backend
is one module plus one `register(BackendEntry(...))` line (a built-in one: a `_builtin` line
below and its row in config/schemes.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from jobfence.config import urls
from jobfence.config.schemes import LOCK_SCHEMES

if TYPE_CHECKING:
    from jobfence.locks.backend import LockBackend

Feature = Literal[
    "native_fencing", "durable_fence", "ha", "release_notify", "semaphore", "rate_limit"
]


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees, so callers can refuse a backend too weak for them."""

    native_fencing: bool  # grants carry a strictly increasing token
    durable_fence: bool  # tokens keep increasing if the server loses its data
    ha: bool  # survives the loss of one server
    release_notify: bool  # waiters are woken on release instead of polling
    semaphore: bool = False  # keeps counting semaphores (Locker.semaphore, concurrency=)
    rate_limit: bool = False  # keeps shared GCRA rate limits on its own clock (take_rate)


@dataclass(frozen=True)
class BackendEntry:
    """One lock backend: the schemes that pick it and where its class lives.

    `capabilities` is the class's own table, readable without importing the module (whose
    client library may not be installed); a test keeps the two equal. `check_url(url,
    variable)` raises UnsafeSettings naming `variable` for an unusable URL; None: the
    one-host checks (a host, a numeric port, no '/' or '#' in the password).
    """

    name: str  # the class's `name`, as metrics, logs and refusals show it
    schemes: tuple[str, ...]  # the first is the one messages name
    module: str
    class_name: str
    capabilities: Capabilities
    extra: str | None = None  # `pip install 'jobfence[<extra>]'` installs its library
    requires: str | None = None  # the import name of that library
    check_url: Callable[[str, str], object] | None = None
    default_port: int | None = None
    tls_scheme: str | None = None  # the scheme that asks for TLS, if the backend has one
    fleet: bool = True  # False: one process only (not a lock server a fleet can share)
    # "module:Class" of a native asyncio store (AsyncLocker); None: the sync backend in a thread
    async_store: str | None = None

    @property
    def install_hint(self) -> str:
        return f"pip install 'jobfence[{self.extra}]'" if self.extra else ""

    def load(self, scheme: str | None = None) -> type[LockBackend]:
        """The backend class, importing its module now; a missing extra names its install."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            missing = exc.name or ""
            if not self.requires or missing.split(".")[0] != self.requires:
                raise  # not the optional library: a real error, shown as it is
            raise MissingExtra(
                f"the {scheme or self.schemes[0]}:// lock backend needs {self.requires}: "
                f"{self.install_hint}",
                name=exc.name,
            ) from exc
        cls: type[LockBackend] = getattr(module, self.class_name)
        return cls

    def validate_url(self, url: str, variable: str) -> None:
        (self.check_url or urls.check_one_host)(url, variable)


class MissingExtra(ModuleNotFoundError):
    """A lock URL's backend needs an optional library that is not installed; names the extra."""


_ENTRIES: dict[str, BackendEntry] = {}  # by name, in registration order
_BY_SCHEME: dict[str, BackendEntry] = {}


def register(entry: BackendEntry) -> BackendEntry:
    """Add `entry`; each of its schemes (lower case) must be new."""
    schemes = [s.lower() for s in entry.schemes]
    if not schemes:
        raise ValueError(f"backend {entry.name!r} has no schemes; give it at least one")
    taken = [s for s in schemes if s in _BY_SCHEME]
    if taken or entry.name in _ENTRIES:
        owner = _BY_SCHEME[taken[0]].name if taken else entry.name
        raise ValueError(f"backend {entry.name!r}: {'scheme ' + taken[0] if taken else 'name'} "
                         f"is already registered by {owner!r}; pick another")  # fmt: skip
    _ENTRIES[entry.name] = entry
    _BY_SCHEME.update(dict.fromkeys(schemes, entry))
    for scheme in schemes:  # the settings check (config/urls/) takes it from now on
        urls.accept_lock_scheme(scheme, entry.validate_url)
    return entry


def unregister(name: str) -> None:
    """Remove the backend `name` (tests that register one of their own)."""
    entry = _ENTRIES.pop(name)
    for scheme in entry.schemes:
        _BY_SCHEME.pop(scheme.lower(), None)
        urls.forget_lock_scheme(scheme.lower())


def entry(name: str) -> BackendEntry:
    """The backend registered as `name` ("redis", "postgres", ...)."""
    return _ENTRIES[name]


def entries() -> tuple[BackendEntry, ...]:
    return tuple(_ENTRIES.values())


def lock_schemes() -> tuple[str, ...]:
    """Every scheme a lock URL may have, in registration order."""
    return tuple(s for e in _ENTRIES.values() for s in e.schemes)


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def entry_for(url: str) -> BackendEntry:
    """The backend `url`'s scheme picks; ValueError naming every scheme if none does."""
    entry = _BY_SCHEME.get(scheme_of(url))
    if entry is None:
        raise ValueError(f"no lock backend for scheme {url.split('://', 1)[0]!r}; use "
                         f"{_either(s + '://' for s in lock_schemes())}")  # fmt: skip
    return entry


def check_lock_url(url: str, variable: str) -> None:
    """Raise UnsafeSettings (one line naming `variable`) unless a backend takes `url`."""
    urls.check_lock_url(url, variable)  # kept in step with this registry by `register`


def backends_with(feature: Feature, *, fleet: bool = True) -> str:
    """The schemes of the backends that have `feature`, for a refusal's fix ("redis://,
    postgresql:// or mysql://"); with `fleet`, only those a fleet of processes can share."""
    return _either(
        e.schemes[0] + "://"
        for e in _ENTRIES.values()
        if getattr(e.capabilities, feature) and (e.fleet or not fleet)
    )


def _either(names: Iterable[str]) -> str:
    items = list(names)
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else "".join(items)


_BACKENDS = "jobfence.locks.backends."
# A lock server with every feature, and without: most entries differ only in a flag or two.
_FULL = Capabilities(
    native_fencing=True, durable_fence=True, ha=False, release_notify=True,
    semaphore=True, rate_limit=True,
)  # fmt: skip
_LEASES = Capabilities(native_fencing=True, durable_fence=True, ha=True, release_notify=True)


def _builtin(
    name: str, module: str, class_name: str, capabilities: Capabilities, **options: Any
) -> BackendEntry:
    """A built-in backend's entry: its schemes from the schemes' table (config/schemes.py),
    its URL check from config/urls/'s."""
    row = LOCK_SCHEMES[name]
    return BackendEntry(
        name, row.schemes, _BACKENDS + module, class_name, capabilities,
        check_url=urls.LOCK_URL_CHECKS.get(name), tls_scheme=row.tls, **options,
    )  # fmt: skip


register(_builtin(
    "redis", "redis", "RedisBackend", _FULL, default_port=6379,
    async_store=_BACKENDS + "redis.async_store:AsyncRedisStore",
))  # fmt: skip
register(_builtin("memory", "memory", "MemoryBackend", replace(_FULL, durable_fence=False),
                  fleet=False))  # fmt: skip
register(_builtin(
    "postgres", "postgres", "PostgresBackend", _FULL, extra="postgres", requires="psycopg",
    default_port=5432, async_store=_BACKENDS + "postgres.async_store:AsyncPostgresStore",
))  # fmt: skip
register(_builtin(
    "mysql", "mysql", "MySQLBackend", replace(_FULL, release_notify=False), extra="mysql",
    requires="pymysql", default_port=3306,
))  # fmt: skip
register(_builtin(
    "redlock", "redlock", "RedlockBackend", replace(_LEASES, durable_fence=False),
    default_port=6379, async_store=_BACKENDS + "redlock.store_async:AsyncRedlockStore",
))  # fmt: skip
register(_builtin("etcd", "etcd", "EtcdBackend", replace(_LEASES, ha=False), default_port=2379))
register(_builtin(
    "redis-cluster", "redis.cluster", "RedisClusterBackend", _FULL, default_port=6379,
    async_store=_BACKENDS + "redis.cluster_async:AsyncClusterStore",
))  # fmt: skip
register(_builtin(
    "redis-sentinel", "redis.sentinel", "RedisSentinelBackend", replace(_FULL, ha=True),
    default_port=26379, async_store=_BACKENDS + "redis.sentinel_async:AsyncSentinelStore",
))  # fmt: skip
register(_builtin(
    "zookeeper", "zookeeper", "ZooKeeperBackend", _LEASES, extra="zookeeper", requires="kazoo",
    default_port=2181,
))  # fmt: skip
