"""Start-up checks that talk to a server: the lock backend's own (it answers, as the server its
URL names, and cannot evict keys), the key secret's id on the lock server, and a Redis broker's
eviction policy."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from jobfence.config import UnsafeSettings
from jobfence.config.findings import Finding, LockTarget
from jobfence.config.findings import refuse as _refuse
from jobfence.config.findings import warn as _warn
from jobfence.config.schemes import UNIX_SCHEME, backend_schemes
from jobfence.config.settings import ENV_PREFIX
from jobfence.config.urls import check_url, redact, redlock_masters
from jobfence.locks import BackendUnavailable, registry
from jobfence.locks.backends.redis.checks import (
    CREDENTIALS_FIX,
    check_eviction,
    credentials_refused,
)
from jobfence.locks.backends.redis.url import tls_hint
from jobfence.tasks import Runtime
from jobfence.tasks.keys import secret_id
from jobfence.worker import broker_tls
from jobfence.worker.settings_checks import singleton_ttls

log = logging.getLogger("jobfence.worker.checks")  # the start-up checks' logger, as before

#: Where the lock server keeps the key secret's id (no job key: those hold a ':').
SECRET_ID_KEY = "key-secret-id"
#: It must outlive every DONE record under the secret; it is refreshed at each start.
SECRET_ID_RETENTION = 10 * 365 * 24 * 3600.0
REDIS_SCHEMES = registry.entry("redis").schemes


def check_lock_backend(
    conf: Any, runtime: Runtime, tasks: Iterable[Any] = ()
) -> Iterator[Finding]:
    """A lock server a fleet can share, and what its backend's own start-up checks find
    (`LockBackend.startup_findings`, in each backend's module)."""
    target = lock_target(runtime, tasks)
    entry = _entry(target.url)
    if entry is not None and not entry.fleet and not conf.task_always_eager:
        yield _refuse(
            target.setting,
            f"{entry.schemes[0]}:// locks live in one process; worker processes would not "
            "see each other's locks",
            "point it at a Redis server, e.g. redis://127.0.0.1:6379/0",
        )
        return
    yield from runtime.backend.startup_findings(target)


def lock_target(runtime: Runtime, tasks: Iterable[Any] = ()) -> LockTarget:
    """What the lock backend's start-up checks are told: its URL's variable and value, the
    socket timeout, and every lease TTL the app asks for (the default and each task's)."""
    settings = runtime.settings
    ttls = (settings.default_ttl, *(ttl for _, ttl in singleton_ttls(tasks)))
    return LockTarget(f"{ENV_PREFIX}LOCK_URL", settings.lock_url, settings.socket_timeout, ttls)


def _entry(url: str) -> registry.BackendEntry | None:
    try:
        return registry.entry_for(url)
    except ValueError:
        return None


def check_key_secret(runtime: Runtime) -> Iterator[Finding]:
    """Refuse a key secret that would silently re-run finished jobs (how-to: rotate-key-secret).

    The lock server keeps the id of the secret in use (`secret_id`, never the secret). A
    secret whose id is neither that one nor one of JOBFENCE_KEY_SECRET_PREVIOUS's would look
    for every DONE record and held lock under new names; JOBFENCE_KEY_SECRET_RESET allows it.
    """
    backend, settings = runtime.backend, runtime.settings
    mine = secret_id(runtime.secret)
    try:
        stored = backend.swap_publish(SECRET_ID_KEY, mine, mine, SECRET_ID_RETENTION)
        if stored is None:  # first start, or the same secret: kept and refreshed
            return
        known = {secret_id(old) for old in runtime.previous_secrets}
        if stored in known or settings.key_secret_reset:
            if stored not in known:
                log.warning(
                    "jobfence: JOBFENCE_KEY_SECRET_RESET: a new key secret replaces "
                    "id %s; jobs finished under the old one may run again",
                    stored,
                )
            backend.swap_publish(SECRET_ID_KEY, stored, mine, SECRET_ID_RETENTION)
            return
    except BackendUnavailable:
        return  # the lock backend's own check reports the lock server down; nothing to compare with
    p = ENV_PREFIX
    yield _refuse(
        f"{p}KEY_SECRET",
        f"is not the key secret the lock server's job records and locks were written under "
        f"(stored id {stored}, this one {mine}): every finished job would run again",
        f"to rotate, keep the old secret in {p}KEY_SECRET_PREVIOUS while the new one rolls out "
        f"(docs/how-to/rotate-key-secret.md); to start afresh on purpose, set "
        f"{p}KEY_SECRET_RESET=true for one start",
    )


def same_server(a: str, b: str) -> bool:
    """Whether Redis URL `a` names the server (or a Redlock master) of lock URL `b`."""
    if urlsplit(b).scheme in backend_schemes("redlock").schemes:  # each master, as a lock server
        return any(same_server(a, master) for master in redlock_masters(b))
    pa, pb = urlsplit(a), urlsplit(b)
    if pb.scheme not in REDIS_SCHEMES:  # a database, etcd, ZooKeeper: never the Redis broker
        return False
    if UNIX_SCHEME in (pa.scheme, pb.scheme):
        return pa.path == pb.path
    return (pa.hostname, pa.port or 6379) == (pb.hostname, pb.port or 6379)


def check_broker(conf: Any, runtime: Runtime) -> Iterator[Finding]:
    """A Redis broker that evicts loses messages: refuse it (skipped if it is the lock server)."""
    url = str(conf.broker_url or "")
    if urlsplit(url).scheme not in REDIS_SCHEMES:
        return
    try:  # the app's own broker_url need not have passed Settings' checks
        check_url(url, variable="broker_url", schemes=None, what="broker URL",
                  example="redis://127.0.0.1:6379/1")
    except UnsafeSettings as bad:
        yield _refuse(bad.field, bad.problem, bad.fix)
        return
    if same_server(url, runtime.settings.lock_url):
        return
    timeout = runtime.settings.socket_timeout
    # A user's own app (jobfence.setup) sets its broker itself, not through JOBFENCE_*.
    setting = f"{ENV_PREFIX}BROKER_URL" if url == runtime.settings.broker_url else "broker_url"
    try:  # a CA or certificate file the URL names must be readable: not an outage later
        broker_tls.use_ssl(url, setting)
    except UnsafeSettings as bad:
        yield _refuse(bad.field, bad.problem, bad.fix)
        return
    tls = broker_tls.broker_client_tls(conf)
    options: dict[str, Any] = {}
    if tls is not None:
        if tls.unverified() and not _allowed(conf, runtime):
            return  # refused by the security check: no password over an unverified channel
        # The TLS kombu will use (broker_use_ssl, the URL's ssl_ options), not redis-py's own.
        options = {} if tls.plain else dict(tls.options)
    client = redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0), **options,
    )
    try:
        yield from _broker_findings(client, url, setting)
    finally:
        client.close()


def _broker_findings(client: Any, url: str, setting: str) -> Iterator[Finding]:
    """Ping the broker: refuse wrong credentials or a certificate that does not verify, warn
    if it does not answer yet; else check its eviction policy."""
    try:
        client.ping()
    except RedisError as exc:
        wrong = credentials_refused(exc)
        if wrong:
            yield _refuse(setting, f"the broker at {redact(url)} {wrong}", CREDENTIALS_FIX)
            return
        hint = tls_hint(exc)
        if hint:  # a certificate that does not verify is no outage: never start with it
            yield _refuse(setting, f"the broker at {redact(url)} cannot be used ({exc})",
                          hint.replace("the lock server", "the broker"))
            return
        yield _warn(
            setting,
            f"cannot reach the broker at {redact(url)} yet ({exc}); its eviction policy "
            "is unchecked",
            "make sure the broker runs with maxmemory-policy noeviction",
        )
        return
    yield from check_eviction(client, "broker", setting, url)


def _allowed(conf: Any, runtime: Runtime) -> bool:
    """Whether JOBFENCE_ALLOW_INSECURE allows every broker TLS downgrade of `conf`."""
    allowed = set(runtime.settings.allow_insecure)
    return all(d.item in allowed for d in broker_tls.downgrades(conf, runtime.settings))


