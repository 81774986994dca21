"""The zookeeper:// URL grammar: hosts, an optional chroot, digest auth and TLS options."""

from __future__ import annotations

from urllib.parse import unquote

from jobfence.config.errors import UnsafeSettings
from jobfence.config.urls.redact import redact, split_userinfo

# KazooClient's TLS arguments, as locks.backends.zookeeper.TLS_OPTIONS (kazoo not imported here)
ZOOKEEPER_OPTIONS = ("use_ssl", "ca", "certfile", "keyfile", "verify_certs", "check_hostname")


def check_zookeeper_url(url: str, variable: str) -> None:
    """zookeeper://host:port[,host:port...][/chroot]: every host named, every port a number."""
    fix = f"set {variable} to a URL such as zookeeper://zk1:2181,zk2:2181,zk3:2181/jobfence"
    shown = redact(url)
    userinfo, rest = split_userinfo(url)
    user, colon, password = userinfo.partition(":")
    if userinfo and (not user or not colon or not password or ":" in unquote(user)):
        raise UnsafeSettings(
            variable, f"{shown!r} has user-info that is not user:password (digest auth)",
            f"set {variable} to a URL such as zookeeper://user:password@zk1:2181/jobfence, "
            "percent-encoded, with no ':' in the user name",
        )
    if "#" in rest:
        raise UnsafeSettings(variable, f"{shown!r} has a fragment", fix)
    rest, _, query = rest.partition("?")
    for name in (pair.partition("=")[0] for pair in query.split("&") if pair):
        if name not in ZOOKEEPER_OPTIONS:
            raise UnsafeSettings(
                variable, f"{shown!r} has option {name!r}, which zookeeper:// does not take",
                f"use only {', '.join(ZOOKEEPER_OPTIONS)} (TLS) in the query",
            )
    hosts, _, chroot = rest.partition("/")
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":")
        if not colon:
            host, port = item, "2181"
        if not host:
            raise UnsafeSettings(variable, f"{shown!r} names no host in {item!r}", fix)
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UnsafeSettings(variable, f"{shown!r} has port {port!r} in {item!r}", fix)
    if chroot and any(p in ("", ".", "..") for p in chroot.rstrip("/").split("/")):
        raise UnsafeSettings(variable, f"{shown!r} has chroot /{chroot}, not a node path", fix)
