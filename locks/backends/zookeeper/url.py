"""zookeeper:// URLs: the ensemble, the chroot, the digest identity, KazooClient's TLS options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from jobfence.locks import registry
from jobfence.locks.backends.common import flag_value

SCHEMES = registry.entry("zookeeper").schemes  # the registry is the one list
DEFAULT_PORT = 2181

TLS_OPTIONS = ("use_ssl", "ca", "certfile", "keyfile", "verify_certs", "check_hostname")


@dataclass(frozen=True)
class Target:
    """What a zookeeper:// URL names: the ensemble, the chroot, the digest identity, TLS."""

    hosts: str  # kazoo's host list 'h1:p1,h2:p2'
    chroot: str  # '' or '/a/b'
    auth: tuple[str, str] | None = field(default=None, repr=False)  # (user, password)
    tls: dict[str, Any] = field(default_factory=dict)  # KazooClient's TLS arguments

    @property
    def user(self) -> str | None:
        return self.auth[0] if self.auth else None


def parse_url(url: str) -> tuple[str, str]:
    """(kazoo host list 'h1:p1,h2:p2', chroot '' or '/a/b') of a zookeeper:// URL."""
    target = parse_target(url)
    return target.hosts, target.chroot


def parse_target(url: str) -> Target:
    """`zookeeper://[user:password@]host:port[,host:port...][/chroot][?TLS options]`.

    The user-info (percent-encoded) is a digest identity: the client authenticates with it
    and every node jobfence creates gets an ACL giving that identity alone any access. TLS
    options are KazooClient's: any of `use_ssl=true`, `ca`, `certfile`, `keyfile` turns TLS on,
    which verifies the certificate and the host name unless `verify_certs=false` /
    `check_hostname=false` says otherwise. Errors never quote the password."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in SCHEMES:
        raise ValueError(f"not a ZooKeeper URL: {parts.scheme}://")
    userinfo, at, netloc = parts.netloc.rpartition("@")
    auth = _digest_identity(userinfo) if at else None
    if parts.fragment:
        raise ValueError("zookeeper:// URLs take no fragment")
    hosts = _host_list(netloc)
    chroot = parts.path.rstrip("/")
    if chroot and any(p in ("", ".", "..") for p in chroot[1:].split("/")):
        raise ValueError(f"zookeeper:// chroot {parts.path!r} is not a valid node path")
    return Target(hosts, chroot, auth, _tls_options(parts.query))


def _digest_identity(userinfo: str) -> tuple[str, str]:
    """(user, password) of the URL's user-info, percent-decoded; the error never quotes it."""
    user, colon, password = userinfo.partition(":")
    user, password = unquote(user), unquote(password)
    if not user or not colon or not password:
        raise ValueError(
            "zookeeper:// user-info needs a user and a password for digest authentication: "
            "zookeeper://user:password@host:2181/chroot (percent-encoded)"
        )
    if ":" in user:
        raise ValueError(
            "the zookeeper:// user name holds a ':', which digest authentication cannot "
            "carry; choose a user name without one"
        )
    return user, password


def _host_list(netloc: str) -> str:
    """kazoo's host list 'h1:p1,h2:p2' of the URL's hosts (the port 2181 where none is given)."""
    hosts = []
    for item in netloc.split(","):
        host, colon, port = item.rpartition(":")
        if not colon or "]" in port:
            host, port = item, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"zookeeper:// host {item!r} is not host:port")
        hosts.append(f"{host}:{port}")
    return ",".join(hosts)


def _flag(name: str, value: str) -> bool:
    if (flag := flag_value(value)) is not None:
        return flag
    raise ValueError(f"zookeeper:// option {name}={value!r} is not true or false")


def _tls_options(query: str) -> dict[str, Any]:
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in TLS_OPTIONS:
            raise ValueError(
                f"unknown option {name!r} in the zookeeper:// URL; known: {', '.join(TLS_OPTIONS)}"
            )
        options[name] = value
    files: dict[str, Any] = {n: options[n] for n in ("ca", "certfile", "keyfile") if n in options}
    for name, path in files.items():
        if not path:
            raise ValueError(f"zookeeper:// option {name}= is empty: give a PEM file path")
    use_ssl = _flag("use_ssl", options["use_ssl"]) if "use_ssl" in options else None
    if use_ssl is False:
        if len(options) > 1:
            raise ValueError(
                "the zookeeper:// URL gives use_ssl=false with other TLS options; drop one"
            )
        return {}
    if not use_ssl and not files:
        if options:
            raise ValueError(
                "the zookeeper:// URL gives verify_certs/check_hostname without TLS: add "
                "use_ssl=true (and ca=/path/ca.pem)"
            )
        return {}
    if "keyfile" in files and "certfile" not in files:
        raise ValueError("the zookeeper:// URL gives keyfile without certfile: add certfile=")
    verify = _flag("verify_certs", options.get("verify_certs", "true"))
    hostname = _flag("check_hostname", options.get("check_hostname", str(verify)))
    if hostname and not verify:
        raise ValueError(
            "the zookeeper:// URL gives check_hostname=true with verify_certs=false: a host "
            "name is checked only on a verified certificate; drop verify_certs=false"
        )
    return {"use_ssl": True, **files, "verify_certs": verify, "check_hostname": hostname}
