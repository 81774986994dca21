"""The redis+sentinel:// URL grammar: the sentinels, the master they monitor, both logins, TLS."""

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

SENTINEL_EXAMPLE = "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/mymaster/0"


@dataclass(frozen=True)
class SentinelTarget:
    """What a redis+sentinel:// URL names: the sentinels, the master's name, its database,
    the credentials of the master (and its replicas), the sentinels' own credentials
    (`sentinel_username`, `sentinel_password`: none unless given) and the TLS of both."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None = field(repr=False)
    tls: RedisTls = field(default_factory=RedisTls)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


#: The options of a redis+sentinel:// URL: TLS, and the sentinels' own credentials.
SENTINEL_OPTIONS = (*REDIS_TLS_OPTIONS, "sentinel_username", "sentinel_password")


def sentinel_target(url: str, variable: str = "JOBFENCE_LOCK_URL") -> SentinelTarget:
    """Parse `redis+sentinel://[user:password@]host:port[,host:port...]/<master-name>[/db]`
    (`rediss+sentinel://` for TLS to the sentinels and the master, with the ssl_ options;
    `?sentinel_password=` for sentinels that ask for one).

    Each host is a sentinel (port 26379 if left out), the path names the master the
    sentinels monitor (`sentinel monitor <master-name> ...`) and optionally its database.
    """
    fix = f"set {variable} to a URL such as {SENTINEL_EXAMPLE}"
    scheme = backend_schemes("redis-sentinel").plain
    shown, userinfo, rest, options = multi_host(url, scheme, variable, fix, SENTINEL_OPTIONS)
    tls = redis_tls(url, options, variable)
    if "sentinel_username" in options and not options.get("sentinel_password"):
        raise UnsafeSettings(
            variable, f"{shown!r} has sentinel_username= without sentinel_password=",
            "give the sentinels' password too: ?sentinel_username=u&sentinel_password=p",
        )
    hosts, _, path = rest.partition("/")
    sentinels = [
        (h.strip("[]"), p) for h, p in host_list(hosts, "sentinel", 26379, shown, variable, fix)
    ]
    if len(set(sentinels)) != len(sentinels):
        raise UnsafeSettings(variable, f"{shown!r} names a sentinel more than once",
                             "list each sentinel once")  # fmt: skip
    service, db = _master(path, shown, variable, fix)
    user, colon, password = userinfo.partition(":")
    return SentinelTarget(
        sentinels=tuple(sentinels),
        service=unquote(service),
        db=int(db or 0),
        username=unquote(user) or None,
        password=unquote(password) if colon else None,
        tls=tls,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
    )


def _master(path: str, shown: str, variable: str, fix: str) -> tuple[str, str]:
    """(the master's name as written, its database or '') of the URL's path."""
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise UnsafeSettings(
            variable,
            f"{shown!r} names no master: the path must be the name the sentinels monitor "
            "it by (sentinel monitor <name> ...)",
            fix,
        )
    if db and not db.isdigit():
        raise UnsafeSettings(
            variable, f"{shown!r} has database {db!r}, which is not a number (or a '/' in the "
            "master's name)", fix,
        )
    return service, db
