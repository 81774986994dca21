"""Security posture of the settings: TLS, credentials and host of each URL, key-secret strength."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qsl, unquote

from jobfence.config.errors import UnsafeSettings
from jobfence.config.schemes import (
    UNIX_SCHEME,
    backend_schemes,
    redis_family_schemes,
    tls_schemes,
)
from jobfence.config.urls import host_port, redact, split_userinfo

ALLOW_VARIABLE = "JOBFENCE_ALLOW_INSECURE"
#: What JOBFENCE_ALLOW_INSECURE may name: each a downgrade that start-up otherwise refuses.
INSECURE_ITEMS: dict[str, str] = {
    "unverified-tls": "TLS whose certificate or host name is not verified "
    "(ssl_cert_reqs=none, ssl_check_hostname=false, sslmode below verify-full)",
    "cleartext": "a password sent without TLS to a server on another host",
    "no-auth": "no password or client certificate for a server on another host",
    "weak-key-secret": "a key secret shorter than 32 characters, or the public development "
    "default with a lock server on another host",
}
#: Shortest key secret accepted: 32 characters of a random string (about 190 bits as base64).
MIN_KEY_SECRET = 32
DEV_SECRET = "jobfence-insecure-dev-secret"

# Schemes whose server lives in this process or on this host's file system: nothing to check.
# The lock schemes come from config/schemes.py; the others here are Celery's broker and
# result-backend spellings, which no lock backend takes.
_LOCAL_SCHEMES = frozenset({*backend_schemes("memory").schemes, "sqlite", "rpc", "file",
                            "cache+memory", "db+sqlite"})  # fmt: skip
_REDIS = (redis_family_schemes() - {UNIX_SCHEME}) | {"sentinel"}
_POSTGRES = frozenset({
    *backend_schemes("postgres").schemes, "postgresql+psycopg2", "db+postgresql",
    "db+postgresql+psycopg", "db+postgresql+psycopg2",
})  # fmt: skip
_MYSQL = frozenset({*backend_schemes("mysql").schemes, "mariadb+pymysql", "db+mysql",
                    "db+mysql+pymysql"})  # fmt: skip
_TLS_SCHEMES = tls_schemes() | {"amqps", "https", "sqs"}
_FALSE = frozenset({"false", "0", "no", "off", "none", "cert_none", "optional",
                    "cert_optional"})  # fmt: skip
_TRUE = frozenset({"true", "1", "yes", "on", "required", "cert_required"})
# Query options that turn verification off when false, in each client's spelling.
_VERIFY_OPTIONS = ("ssl_cert_reqs", "ssl_check_hostname", "check_hostname", "ssl_verify_cert",
                   "ssl_verify_identity", "verify", "verify_certs", "tls_verify")  # fmt: skip
# Query options that turn TLS on when true (or name a CA / client certificate file).
_TLS_OPTIONS = ("ssl", "tls", "use_ssl", "ssl_ca", "ssl_ca_certs", "ssl_cert", "ssl_certfile",
                "ssl_ca_path", "ca_cert", "cacert", "tls_ca")  # fmt: skip
_CLIENT_CERT = ("ssl_certfile", "ssl_cert", "sslcert", "cert", "client_cert", "tls_cert")
#: Query options that set a lock-server timeout: the client prefers them to
#: JOBFENCE_SOCKET_TIMEOUT.
TIMEOUT_OPTIONS = ("socket_timeout", "socket_connect_timeout", "connect_timeout",
                   "read_timeout", "write_timeout")  # fmt: skip


@dataclass(frozen=True)
class UrlPosture:
    """What a URL gives away: is its host this one, is it TLS (and verified), does it log in."""

    variable: str
    shown: str  # redacted
    loopback: bool
    tls: str  # "verified", "unverified (why)", "off"
    password: bool
    client_cert: bool

    @property
    def auth(self) -> bool:
        return self.password or self.client_cert

    def line(self) -> str:
        how = " (password)" if self.password else " (client cert)" if self.client_cert else ""
        auth = f"yes{how}" if self.auth else "no"
        return (
            f"{self.variable} {self.shown}: TLS {self.tls}; auth {auth}; "
            f"loopback {'yes' if self.loopback else 'no'}"
        )


@dataclass(frozen=True)
class Downgrade:
    """One weakening found: `item` is the JOBFENCE_ALLOW_INSECURE name that allows it."""

    item: str
    variable: str
    problem: str
    fix: str


def is_loopback(host: str | None) -> bool:
    """True for localhost, 127.0.0.0/8, ::1, and a socket: no host at all, or a directory
    (libpq's `host=/run/postgresql`)."""
    host = (host or "").strip("[]")
    if not host or host.lower() == "localhost" or host.startswith("/"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hosts(url: str) -> list[str]:
    """Every host a URL names (a comma list for redlock, sentinel, cluster, etcd, zookeeper)."""
    authority = split_userinfo(url)[1]
    for sep in "/?#":
        authority = authority.split(sep, 1)[0]
    hosts = []
    for part in authority.split(","):
        host, _ = host_port(f"x://{part.strip()}")
        hosts.append(host)
    return hosts


def _query_values(url: str, *names: str) -> list[str]:
    """Every value the URL's query gives any of `names` (repeats and comma lists split)."""
    rest = split_userinfo(url)[1]
    query = rest.partition("?")[2].partition("#")[0]
    return [part.strip() for k, v in parse_qsl(query, keep_blank_values=True)
            if k.lower() in names for part in v.split(",")]  # fmt: skip


def _postgres_hosts(url: str) -> list[str]:
    """Every host libpq may connect to for `url`: the URL's authority and each `host=` and
    `hostaddr=` in its query (libpq takes the last, SQLAlchemy joins them all), else
    PGHOST/PGHOSTADDR, else the default socket (""). A service (`service=`, PGSERVICE)
    names hosts in a file: "?service", judged another host."""
    if _query_values(url, "service") or os.environ.get("PGSERVICE"):
        return ["?service"]
    named = [unquote(h) for h in _hosts(url) if h] + _query_values(url, "host")
    addrs = _query_values(url, "hostaddr") or os.environ.get("PGHOSTADDR", "").split(",")
    if not [h for h in named if h]:
        named = os.environ.get("PGHOST", "").split(",")
    hosts = [h.strip() for h in (*named, *addrs) if h.strip()]
    return hosts or [""]


def _query(url: str) -> dict[str, str]:
    rest = split_userinfo(url)[1]
    query = rest.partition("?")[2].partition("#")[0]
    return {k.lower(): v for k, v in parse_qsl(query, keep_blank_values=True)}


def query_timeouts(url: str) -> dict[str, float | None]:
    """The timeout options `url`'s query sets (None: not a number), which win over settings."""
    found: dict[str, float | None] = {}
    for name, value in _query(url).items():
        if name in TIMEOUT_OPTIONS:
            try:
                found[name] = float(value)
            except ValueError:
                found[name] = None
    return found


def url_posture(url: str | None, variable: str) -> UrlPosture | None:
    """The posture of one server URL; None when there is no server to judge (memory://,
    sqlite://, rpc://, a unix socket) or no URL."""
    if not url or "://" not in url:
        return None
    scheme = url.split("://", 1)[0].lower()
    if scheme in _LOCAL_SCHEMES or scheme.startswith(UNIX_SCHEME) or scheme.endswith("+socket"):
        return None
    query = _query(url)
    userinfo = split_userinfo(url)[0]
    _, colon, password = userinfo.partition(":")
    has_password = bool(colon and unquote(password)) or any(
        k in query for k in ("password", "passwd", "pwd")
    )
    client_cert = any(query.get(k) for k in _CLIENT_CERT)
    base = scheme.split("+", 1)[-1] if scheme.startswith("db+") else scheme
    if base in _POSTGRES or scheme in _POSTGRES:
        hosts = _postgres_hosts(url)
    else:  # SQLAlchemy's MySQL dialects take a `host=` in the query over the authority's
        extra = _query_values(url, "host") if scheme in _MYSQL or base in _MYSQL else []
        hosts = _hosts(url) + extra
    loopback = all(is_loopback(h) for h in hosts)
    return UrlPosture(
        variable=variable,
        shown=redact(url),
        loopback=loopback,
        tls=_tls(scheme, query),
        password=has_password,
        client_cert=client_cert,
    )


def _tls(scheme: str, query: Mapping[str, str]) -> str:
    base = scheme.split("+", 1)[-1] if scheme.startswith("db+") else scheme
    if base in _POSTGRES or scheme in _POSTGRES:
        mode = query.get("sslmode", "prefer").lower()
        if mode == "disable":
            return "off"
        if mode == "verify-full":
            return "verified"
        return f"unverified (sslmode={mode}: the server's certificate or name is not checked)"
    if base in _MYSQL or scheme in _MYSQL:
        return _mysql_tls(query)
    on = scheme in _TLS_SCHEMES or any(
        query.get(k, "").lower() not in ("", *_FALSE) for k in _TLS_OPTIONS
    )
    if not on:
        return "off"
    return _verified(query)


def _mysql_tls(query: Mapping[str, str]) -> str:
    """As jobfence's MySQL connections read the options (locks/backends/mysql/tls.py
    `tls_options`): any ssl_* option asks for TLS, `ssl_mode` says how much is checked."""
    mode = query.get("ssl_mode", "").strip().upper().replace("-", "_")
    if mode == "DISABLED" or query.get("ssl_disabled", "").lower() in _TRUE:
        return "off"
    if not mode and not any(k.startswith("ssl") and k != "ssl_disabled"
                            and query[k].lower() not in _FALSE for k in query):  # fmt: skip
        return "off"
    if mode in ("REQUIRED", "PREFERRED"):
        return f"unverified (ssl_mode={mode}: the certificate is not checked)"
    if mode == "VERIFY_CA":
        return "unverified (ssl_mode=VERIFY_CA: the host name is not checked)"
    return _verified(query)


def _verified(query: Mapping[str, str]) -> str:
    for name in _VERIFY_OPTIONS:
        value = query.get(name, "").lower()
        if value in _FALSE:
            return f"unverified ({name}={value})"
    return "verified"


def with_backend_security(posture: UrlPosture, found: Any) -> UrlPosture:
    """`posture` corrected by what the lock backend itself says of its connection
    (`LockBackend.security()`: tls, verified, hostname_checked, auth), which knows its
    client's defaults better than the URL's text does."""
    if found is None:
        return posture
    if not found.tls:
        tls = "off"
    elif not found.verified:
        tls = "unverified (the certificate is not checked)"
    elif not found.hostname_checked:
        tls = "unverified (the host name is not checked)"
    else:
        tls = "verified"
    auth = bool(found.auth)
    return replace(posture, tls=tls, password=posture.password and auth,
                   client_cert=auth and not posture.password)  # fmt: skip


def url_downgrades(posture: UrlPosture) -> Iterable[Downgrade]:
    """The downgrades one URL's posture amounts to (nothing on loopback but unverified TLS)."""
    v, shown = posture.variable, posture.shown
    if posture.tls.startswith("unverified") and not posture.loopback:
        yield Downgrade(
            "unverified-tls", v, f"{shown} uses TLS {posture.tls}: anyone between this host "
            "and the server can pose as it and read the login",
            "verify the certificate and host name (rediss:// with ssl_ca_certs=, "
            "sslmode=verify-full&sslrootcert=, the default verification left on)",
        )
    if posture.loopback:
        return
    if posture.tls == "off" and posture.password:
        yield Downgrade(
            "cleartext", v, f"{shown} sends its password without TLS to another host",
            "use TLS with verification (rediss://, sslmode=verify-full, amqps://)",
        )
    if not posture.auth:
        yield Downgrade(
            "no-auth", v, f"{shown} reaches a server on another host with no password or "
            "client certificate: anyone who reaches it can read and change what jobfence keeps",
            "turn authentication on in the server and put the credentials in the URL "
            "(user:password@, percent-encoded)",
        )


def key_secret_strength(secret: str) -> str:
    """How strong the key secret looks, never the secret itself."""
    if secret == DEV_SECRET:
        return "the public development default"
    if len(secret) < MIN_KEY_SECRET:
        return f"weak: {len(secret)} characters, fewer than {MIN_KEY_SECRET}"
    return f"{len(secret)} characters, not the default"


def key_secret_downgrades(
    secret: str, variable: str, lock_loopback: bool
) -> Iterable[Downgrade]:
    """A default secret with a lock server elsewhere, or any secret shorter than the minimum."""
    fix = (
        f"set {variable} to a random string of at least {MIN_KEY_SECRET} characters, e.g. "
        "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
    )
    if secret == DEV_SECRET:
        if not lock_loopback:
            yield Downgrade(
                "weak-key-secret", variable, "is the public development default while the "
                "lock server is on another host: anyone can recover low-entropy task "
                "arguments from the key names it stores", fix,
            )
        return
    if len(secret) < MIN_KEY_SECRET:
        yield Downgrade(
            "weak-key-secret", variable, f"has {len(secret)} characters, fewer than "
            f"{MIN_KEY_SECRET}: key names can be matched to guessed task arguments", fix,
        )


def parse_allowed(values: Iterable[str]) -> tuple[str, ...]:
    """The JOBFENCE_ALLOW_INSECURE items, each a known name; refused naming the known ones."""
    items = tuple(v.strip().lower() for v in values if v.strip())
    unknown = [v for v in items if v not in INSECURE_ITEMS]
    if unknown:
        raise UnsafeSettings(
            ALLOW_VARIABLE,
            f"names {', '.join(repr(u) for u in unknown)}, which is not a downgrade it can allow",
            f"use a comma list of {', '.join(INSECURE_ITEMS)} (docs/reference/security.md)",
        )
    return items


def allowed_note(item: str) -> str:
    return f"allowed by {ALLOW_VARIABLE}={item}"


def refusal_fix(d: Downgrade) -> str:
    return f"{d.fix}; or, knowingly, allow it with {ALLOW_VARIABLE}={d.item}"


def postures(urls: Mapping[str, str | None]) -> list[UrlPosture]:
    """The posture of each URL, by the variable that set it (URLs without a server left out)."""
    found = (url_posture(url, variable) for variable, url in urls.items())
    return [p for p in found if p is not None]


def postures_with(urls: Mapping[str, str | None], lock_variable: str,
                  lock_security: Any = None) -> list[UrlPosture]:  # fmt: skip
    """`postures`, the lock URL's corrected by its backend's own `security()` if given."""
    return [
        with_backend_security(p, lock_security) if p.variable == lock_variable else p
        for p in postures(urls)
    ]


def downgrades(
    urls: Mapping[str, str | None], secret: str, lock_variable: str, secret_variable: str,
    lock_security: Any = None,
) -> list[Downgrade]:
    """Every downgrade of these URLs and this key secret (the lock URL decides loopback)."""
    found = postures_with(urls, lock_variable, lock_security)
    lock = next((p for p in found if p.variable == lock_variable), None)
    out = [d for p in found for d in url_downgrades(p)]
    out += key_secret_downgrades(secret, secret_variable, lock is None or lock.loopback)
    return out


def node_downgrades(
    found: Any, node: tuple[str, int], role: str, variable: str = "JOBFENCE_LOCK_URL"
) -> list[Downgrade]:
    """The downgrades of reaching one data node a topology names (a Sentinel's master or
    replica, a node of CLUSTER SLOTS) with the lock connection's options `found` (a backend's
    `Security`): judged as a URL host would be, by the node's own address, not the seeds'."""
    host, port = node
    if is_loopback(host):
        posture = UrlPosture(variable, "", True, "verified", True, False)
    else:
        posture = UrlPosture(variable, f"the {role} {host}:{port}", False, "off", True, False)
    posture = with_backend_security(posture, found)
    return list(url_downgrades(posture))


def refuse_node(
    found: Any, node: tuple[str, int], role: str, allowed: Iterable[str] | None = None,
    variable: str = "JOBFENCE_LOCK_URL",
) -> None:
    """Raise UnsafeSettings for the first downgrade of `node` JOBFENCE_ALLOW_INSECURE (or
    `allowed`) does not name, before the node is sent the password."""
    if allowed is None:
        allowed = parse_allowed(os.environ.get(ALLOW_VARIABLE, "").split(","))
    items = set(allowed)
    for d in node_downgrades(found, node, role, variable):
        if d.item not in items:
            raise UnsafeSettings(
                d.variable, f"names a server elsewhere: {d.problem}", refusal_fix(d)
            )
