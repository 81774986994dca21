"""The lock URL check: each scheme's backend check, kept in step with the lock registry."""

from __future__ import annotations

from jobfence.config.schemes import LOCK_SCHEMES
from jobfence.config.urls.check import (
    LOCK_EXAMPLE,
    UrlCheck,
    check_mysql_url,
    check_one_host,
    check_url,
)
from jobfence.config.urls.etcd import check_etcd_url
from jobfence.config.urls.redact import has_scheme
from jobfence.config.urls.redis import check_redis_url
from jobfence.config.urls.redis_cluster import cluster_target
from jobfence.config.urls.redis_sentinel import sentinel_target
from jobfence.config.urls.redlock import redlock_masters
from jobfence.config.urls.zookeeper import check_zookeeper_url


def check_lock_url(url: str, variable: str) -> None:
    """The lock URL: a scheme a registered backend takes, then that backend's URL checks."""
    check = _LOCK_URL_CHECKS.get(url.split("://", 1)[0].lower()) if has_scheme(url) else None
    if check is None:  # refused here: no scheme, or one no backend takes
        check_url(url, variable=variable, schemes=tuple(_LOCK_URL_CHECKS), example=LOCK_EXAMPLE,
                  what="lock backend")  # fmt: skip
        return
    check(url, variable)


def accept_lock_scheme(scheme: str, check: UrlCheck) -> None:
    """Take lock URLs of `scheme` (lower case), checked by `check` (the registry's register)."""
    _LOCK_URL_CHECKS[scheme] = check


def forget_lock_scheme(scheme: str) -> None:
    """Refuse lock URLs of `scheme` again (the registry's unregister)."""
    _LOCK_URL_CHECKS.pop(scheme, None)


#: Each backend's own lock URL check, by backend name (config/schemes.py); the others get
#: `check_one_host`. The registry gives each built-in backend its check from here.
LOCK_URL_CHECKS: dict[str, UrlCheck] = {
    "redis": check_redis_url,
    "mysql": check_mysql_url,
    "redlock": redlock_masters,
    "etcd": check_etcd_url,
    "redis-cluster": cluster_target,
    "redis-sentinel": sentinel_target,
    "zookeeper": check_zookeeper_url,
}

# Scheme -> check, for the settings check. Built here from the schemes' table, so checking
# settings needs no import of the locks package (which imports this module: the other way
# would be a cycle); locks/registry.py's register and unregister keep it in step with
# backends added or removed at run time, in registration order.
_LOCK_URL_CHECKS: dict[str, UrlCheck] = {
    scheme.lower(): LOCK_URL_CHECKS.get(name, check_one_host)
    for name, row in LOCK_SCHEMES.items()
    for scheme in row.schemes
}
