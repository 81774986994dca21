"""What an etcd lock URL names: its members, TLS options (etcdctl's flags) and user-info."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

from jobfence.config.urls import redact
from jobfence.locks import registry
from jobfence.locks.backends.common import flag_value
from jobfence.locks.errors import LockError

SCHEMES = registry.entry("etcd").schemes  # the registry is the one list
TLS_SCHEME = registry.entry("etcd").tls_scheme  # as https:// in etcdctl's --endpoints
#: TLS options in the URL's query, named as etcdctl's flags (--cacert, --cert, --key,
#: --insecure-skip-tls-verify).
TLS_OPTIONS = ("cacert", "cert", "key", "insecure_skip_tls_verify")
_CREDENTIAL_OPTIONS = ("user", "username", "password", "pass", "passwd", "token")
USERINFO_FIX = "etcds://user:password@host:2379 (percent-encoded)"


@dataclass(frozen=True)
class TLS:
    """HTTPS to every member: the server's certificate checked against `cacert` (else the
    system's CAs) and the host name, unless `verify` is off (a downgrade spelled out);
    `cert` and `key` a client certificate (etcd's --client-cert-auth)."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    verify: bool = True

    def context(self) -> ssl.SSLContext:
        """The SSLContext; LockError naming the option whose file cannot be used."""
        try:
            context = ssl.create_default_context(cafile=self.cacert)
        except (OSError, ssl.SSLError) as exc:
            raise LockError(_file_problem("cacert", self.cacert, exc)) from None
        if self.cert:
            try:
                context.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as exc:
                raise LockError(_file_problem("cert/key", f"{self.cert}, {self.key}", exc)) \
                    from None
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


def _file_problem(option: str, path: str | None, exc: BaseException) -> str:
    why = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or type(exc).__name__
    return (
        f"the etcd lock URL's {option}={path} cannot be used ({why}); fix: give the path of a "
        "readable PEM file (the key unencrypted)"
    )


@dataclass(frozen=True)
class Target:
    """What an etcd lock URL names. The password never shows in its repr."""

    endpoints: list[str]
    tls: TLS | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)


def _flag(name: str, value: str) -> bool:
    if (flag := flag_value(value)) is not None:
        return flag
    raise ValueError(f"etcd lock URL option {name}={value!r} is not true or false")


def parse_target(url: str) -> Target:
    """`etcd[s]://[user:password@]host:port[,host:port...][?TLS options]`; ValueError with
    the fix, never quoting the password.

    `etcds://` is HTTPS (as `https://` endpoints in etcdctl), verifying the certificate
    against `cacert=` (else the system's CAs) and the host name; `cert=`/`key=` give a client
    certificate; `insecure_skip_tls_verify=true` turns the checks off (a downgrade). The
    user-info (percent-encoded) is an etcd user: its token is asked for with the password.
    """
    shown = redact(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"not an etcd URL: {shown.split('://', 1)[0]}:// (use etcd://host:2379)")
    if "#" in rest:
        raise ValueError(f"etcd URL {shown!r} has a fragment; use etcd://host:2379[,host:2379...]")
    rest, _, query = rest.partition("?")
    userinfo, at, hosts = rest.rpartition("@")
    user, password = _credentials(userinfo, shown) if at else (None, None)
    hosts = hosts.rstrip("/")
    if "/" in hosts:
        raise ValueError(f"etcd URL {shown!r} has a path; use etcd://host:2379[,host:2379...]")
    options = _tls_options(query, shown)
    endpoints = _members(hosts, shown)
    return Target(endpoints, _tls(scheme.lower(), options, shown), user, password)


def _credentials(userinfo: str, shown: str) -> tuple[str, str]:
    """(user, password) from the URL's percent-encoded user-info."""
    name, colon, secret = userinfo.partition(":")
    user, password = unquote(name), unquote(secret)
    if not user or not colon or not password:
        raise ValueError(
            f"etcd URL {shown!r} has user-info that is not user:password; use {USERINFO_FIX}"
        )
    return user, password


def _tls_options(query: str, shown: str) -> dict[str, str]:
    """The query's options: TLS ones only, and never credentials."""
    options: dict[str, str] = {}
    for option, value in parse_qsl(query, keep_blank_values=True):
        if option.lower() in _CREDENTIAL_OPTIONS:
            raise ValueError(
                f"etcd URL {shown!r} has option {option!r}: credentials go in the user-info, "
                f"never the query; use {USERINFO_FIX}"
            )
        if option not in TLS_OPTIONS:
            raise ValueError(
                f"etcd URL {shown!r} has option {option!r}, which etcd URLs do not take; "
                f"known: {', '.join(TLS_OPTIONS)} (TLS, with etcds://)"
            )
        options[option] = value
    return options


def _members(hosts: str, shown: str) -> list[str]:
    """host:port of each comma-separated member."""
    endpoints = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host.strip("[]"):
            raise ValueError(f"etcd URL {shown!r}: member {item.strip()!r} is not host:port")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd URL {shown!r} has port {port!r}, not a number in 1-65535")
        endpoints.append(f"{host}:{port}")
    return endpoints


def _tls(scheme: str, options: dict[str, str], shown: str) -> TLS | None:
    if scheme != TLS_SCHEME:
        if options:
            raise ValueError(
                f"etcd URL {shown!r} gives TLS options ({', '.join(options)}) to etcd://, which "
                f"is plain HTTP; use {TLS_SCHEME}://host:2379?cacert=/path/ca.pem"
            )
        return None
    for name in ("cacert", "cert", "key"):
        if name in options and not options[name]:
            raise ValueError(f"etcd URL option {name}= is empty: give a file path")
    if ("cert" in options) != ("key" in options):
        raise ValueError(
            f"etcd URL {shown!r} gives only one of cert and key; a client certificate needs "
            "both: cert=/path/client.pem&key=/path/client.key"
        )
    verify = not _flag("insecure_skip_tls_verify", options.get("insecure_skip_tls_verify", "0"))
    if not verify and "cacert" in options:
        raise ValueError(
            f"etcd URL {shown!r} gives cacert with insecure_skip_tls_verify=true, which never "
            "reads it; drop insecure_skip_tls_verify (the certificate is then checked)"
        )
    return TLS(options.get("cacert"), options.get("cert"), options.get("key"), verify)


def parse_endpoints(url: str) -> list[str]:
    """host:port of each member in `etcd://host:port[,host:port...]`; ValueError with the fix."""
    return parse_target(url).endpoints
