"""The redlock:// URL grammar: an odd number of distinct Redis masters, each one's URL."""

from __future__ import annotations

from urllib.parse import quote, urlencode

from jobfence.config.errors import UnsafeSettings
from jobfence.config.schemes import backend_schemes
from jobfence.config.urls.redis import REDIS_TLS_OPTIONS, host_list, multi_host, redis_tls

REDLOCK_EXAMPLE = "redlock://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379"


def redlock_masters(url: str, variable: str = "JOBFENCE_LOCK_URL") -> list[str]:
    """The redis:// URL of each master a redlock:// URL names, in its order (rediss:// with
    the TLS options, for redlocks://).

    `redlock[s]://[user:password@]host:port,host:port,host:port[,...][/db][?ssl_...]`: an
    odd number of at least three distinct masters, so a majority outlives the loss of any
    minority (an even count tolerates no more failures than the odd count below it, and
    splits votes). The user, password, db and TLS options apply to every master (masters
    with passwords of their own: RedlockBackend takes a list of redis:// or rediss:// URLs).
    """
    fix = f"set {variable} to a URL such as {REDLOCK_EXAMPLE}"
    scheme = backend_schemes("redlock").plain
    shown, userinfo, rest, options = multi_host(url, scheme, variable, fix, REDIS_TLS_OPTIONS)
    tls = redis_tls(url, options, variable)
    hosts, _, tail = rest.partition("/")
    db = tail.strip("/")
    if db and not db.isdigit():
        raise UnsafeSettings(variable, f"{shown!r} has database {db!r}, which is not a number", fix)
    masters = [f"{h}:{p}" for h, p in host_list(hosts, "master", 6379, shown, variable, fix)]
    _refuse_no_majority(masters, shown, variable, fix)
    auth = f"{userinfo}@" if userinfo else ""
    query = f"?{urlencode(tls.query(), safe='/', quote_via=quote)}" if tls.on else ""
    redis = backend_schemes("redis")  # each master is a one-node Redis URL
    each = (redis.tls or redis.plain) if tls.on else redis.plain
    return [f"{each}://{auth}{m}/{db or 0}{query}" for m in masters]


def _refuse_no_majority(masters: list[str], shown: str, variable: str, fix: str) -> None:
    """Each master named once, an odd number of them, at least 3: else refused."""
    duplicates = sorted({m for m in masters if masters.count(m) > 1})
    if duplicates:
        raise UnsafeSettings(
            variable,
            f"{shown!r} names master {duplicates[0]} more than once: one server would cast "
            "several votes of the majority",
            "list each master once",
        )
    if len(masters) < 3 or len(masters) % 2 == 0:
        raise UnsafeSettings(
            variable,
            f"{shown!r} names {len(masters)} master(s); Redlock needs an odd number, at least "
            "3 (3 survive the loss of one, 5 of two; an even count survives no more than the "
            "odd count below it)",
            fix,
        )
