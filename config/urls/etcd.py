"""The etcd[s]:// URL grammar: members as host:port, credentials as user-info, TLS options."""

from __future__ import annotations

from jobfence.config.errors import UnsafeSettings
from jobfence.config.schemes import backend_schemes
from jobfence.config.urls.redact import SECRET_QUERY, redact, split_userinfo

# etcdctl's TLS flags as query options, as locks.backends.etcd.TLS_OPTIONS (not imported here)
ETCD_OPTIONS = ("cacert", "cert", "key", "insecure_skip_tls_verify")
_ETCD_USERINFO = "etcds://user:password@10.0.0.1:2379 (percent-encoded)"


def check_etcd_url(url: str, variable: str) -> None:
    """etcd[s]://[user:password@]host:port[,host:port...][?TLS options]: every member a host
    and a numeric port, no path; credentials only as user-info, TLS options only on etcds://."""
    fix = f"set {variable} to a URL such as etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    shown = redact(url)
    scheme = url.split("://", 1)[0].lower()
    userinfo, rest = split_userinfo(url)
    user, colon, password = userinfo.partition(":")
    if userinfo and (not user or not colon or not password):
        raise UnsafeSettings(
            variable, f"{shown!r} has user-info that is not user:password",
            f"set {variable} to a URL such as {_ETCD_USERINFO}",
        )
    if "#" in rest:
        raise UnsafeSettings(variable, f"{shown!r} has a fragment", fix)
    hosts, _, query = rest.partition("?")
    _check_options(query, scheme, shown, variable)
    _check_members(hosts, shown, variable, fix)


def _check_options(query: str, scheme: str, shown: str, variable: str) -> None:
    """The query: TLS options only, on etcds:// only; never a credential."""
    for name in (pair.partition("=")[0] for pair in query.split("&") if pair):
        if (SECRET_QUERY.search(name) and name != "key") or name.lower() in ("user", "username"):
            raise UnsafeSettings(
                variable, f"{shown!r} has option {name!r}: etcd credentials go in the "
                "user-info, never the query", f"set {variable} to a URL such as {_ETCD_USERINFO}",
            )
        if name not in ETCD_OPTIONS:
            raise UnsafeSettings(
                variable, f"{shown!r} has option {name!r}, which etcd URLs do not take",
                f"use only {', '.join(ETCD_OPTIONS)} (TLS, with etcds://) in the query",
            )
        if scheme != backend_schemes("etcd").tls:
            raise UnsafeSettings(
                variable, f"{shown!r} gives TLS option {name!r} to etcd://, which is plain HTTP",
                f"set {variable} to a URL such as etcds://10.0.0.1:2379?cacert=/path/ca.pem",
            )


def _check_members(hosts: str, shown: str, variable: str, fix: str) -> None:
    """The members (the URL's hosts): each host:port with a port in 1-65535, and no path."""
    hosts = hosts.rstrip("/")
    if "/" in hosts:
        raise UnsafeSettings(
            variable, f"{shown!r} has a path; etcd URLs name members only", fix
        )
    for member in hosts.split(","):
        host, colon, port = member.strip().rpartition(":")
        if not colon or not host.strip("[]"):
            raise UnsafeSettings(
                variable, f"{shown!r}: member {member.strip()!r} is not host:port", fix
            )
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UnsafeSettings(
                variable, f"{shown!r}: member {member.strip()!r} has port {port!r}, not a "
                "number in 1-65535", fix,
            )
