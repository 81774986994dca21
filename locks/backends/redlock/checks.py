"""The Redlock masters' checks: health (a majority answers), TLS and login posture, and the
start-up checks of each master's eviction policy and persistence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError, ResponseError

from jobfence.locks.backend import Security
from jobfence.locks.backends.redis.url import security, tls_hint
from jobfence.locks.backends.redlock.masters import Master
from jobfence.locks.errors import BackendUnavailable

#: One start-up check's outcome: (refuse, problem, fix).
Check = tuple[bool, str, str]


def ping_masters(masters: Sequence[Master], quorum: int) -> str:
    """PING each master: healthy while a majority answers (grants need one)."""
    answered = 0
    hint = None
    for master in masters:
        try:
            answered += bool(master.client.ping())
        except RedisError as exc:
            hint = hint or tls_hint(exc)
    detail = f"{answered} of {len(masters)} masters answered"
    if answered < quorum:
        raise BackendUnavailable(f"{detail}; a majority of {quorum} is needed"
                                 + (f"; {hint}" if hint else ""))  # fmt: skip
    return detail


def masters_security(masters: Sequence[Master]) -> Security:
    """TLS and login as configured, the weakest master's: TLS only if every master's
    sockets are wrapped, auth only if every master gets a password or certificate."""
    each = [security(m.tls, password=bool(m.password)) for m in masters]
    return Security(
        tls=all(s.tls for s in each),
        verified=all(s.verified for s in each),
        hostname_checked=all(s.hostname_checked for s in each),
        auth=all(s.auth for s in each),
    )


def check_masters(masters: Sequence[Master], quorum: int) -> tuple[list[Check], bool]:
    """What about the masters is unsafe (refuse) or weakens a guarantee (warn), and whether
    every master answered and keeps its data through a crash (appendonly yes, appendfsync
    always): the fence is durable only then."""
    found: list[Check] = []
    durable = 0
    for master in masters:
        conf = _settings(master, quorum)
        if isinstance(conf, tuple):  # unreadable: the check that says why
            found.append(conf)
            continue
        found += _eviction(master, conf) + _persistence(master, conf)
        durable += _keeps_fences(conf)
    return found, durable == len(masters)


def _settings(master: Master, quorum: int) -> dict[Any, Any] | Check:
    """The master's eviction and persistence settings, or the check saying why not."""
    try:
        conf = master.client.config_get("maxmemory-policy")
        conf.update(master.client.config_get("append*"))
        return conf
    except ResponseError as exc:
        return (False, f"cannot read the settings of redlock master {master.name} "
                f"({exc}; CONFIG is disabled or not permitted): its eviction "
                "policy and persistence are unchecked",
                "make sure it runs with maxmemory-policy noeviction, appendonly "
                "yes and appendfsync always")  # fmt: skip
    except RedisError as exc:
        return (tls_hint(exc) is not None,  # TLS or login: no outage
                f"redlock master {master.name} does not answer "
                f"({type(exc).__name__}: {exc})" + ("" if tls_hint(exc) else
                f"; grants go on while a majority of {quorum} answers"),
                tls_hint(exc)
                or "start it, or fix the URL if it is wrong")  # fmt: skip


def _eviction(master: Master, conf: dict[Any, Any]) -> list[Check]:
    """Refused: a master that may evict lock, fence and job-record keys."""
    policy = conf.get("maxmemory-policy", "")
    if policy == "noeviction":
        return []
    return [(True, f"redlock master {master.name} has maxmemory-policy "
             f"{policy!r}: under memory pressure it may evict lock, fence "
             "and job-record keys",
             "run every master with --maxmemory-policy noeviction")]  # fmt: skip


def _keeps_fences(conf: dict[Any, Any]) -> bool:
    """Every write on disk before its reply: a crash loses no fence."""
    return conf.get("appendonly") == "yes" and conf.get("appendfsync") == "always"


def _persistence(master: Master, conf: dict[Any, Any]) -> list[Check]:
    """Warned: a master that comes back from a crash without the fences it had."""
    if _keeps_fences(conf):
        return []
    return [(False, f"redlock master {master.name} runs appendonly "
             f"{conf.get('appendonly')!r}, appendfsync "
             f"{conf.get('appendfsync')!r}: after a crash it comes back "
             "without the fences it had, and the fence then rests on the "
             "server clocks (skew between masters below the time between "
             "two grants of a key) and on each client's own floor",
             "run every master with appendonly yes and appendfsync always, "
             "or restart a crashed master only after the longest TTL has "
             "passed")]  # fmt: skip
