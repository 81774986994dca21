"""TLS and credentials of the Redis family's URLs as client options, for every Redis store."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from jobfence.config.errors import UnsafeSettings
from jobfence.config.urls import RedisTls, redis_tls, split_userinfo
from jobfence.locks.backend import Security

__all__ = ["RedisTls", "check_files", "security", "tls_context", "tls_hint", "tls_kwargs",
           "url_tls"]  # fmt: skip

VARIABLE = "JOBFENCE_LOCK_URL"
CA_FILE_HINT = (
    "if its certificate comes from a private CA, pass the CA file in the URL: "
    "rediss://host:6380/0?ssl_ca_certs=/path/ca.pem (a client certificate: "
    "&ssl_certfile=/path/client.crt&ssl_keyfile=/path/client.key)"
)


def url_tls(url: str, variable: str = VARIABLE) -> RedisTls:
    """The TLS of a one-server URL (redis://, rediss://, a Redlock master's): its scheme and
    ssl_ options, parsed as every Redis-family URL is (`config.urls.redis_tls`)."""
    if "://" not in url:
        return RedisTls()
    query = split_userinfo(url)[1].partition("?")[2].partition("#")[0]
    return redis_tls(url, dict(parse_qsl(query, keep_blank_values=True)), variable)


def check_files(tls: RedisTls, variable: str = VARIABLE) -> None:
    """Refuse, naming the option, a CA or certificate file that cannot be read: redis-py
    would only find out at the first connection, as an outage."""
    for name, path in (("ssl_ca_certs", tls.ca_certs), ("ssl_certfile", tls.certfile),
                       ("ssl_keyfile", tls.keyfile)):  # fmt: skip
        if path and not os.access(path, os.R_OK):
            raise UnsafeSettings(
                variable, f"{name}={path} is not a file this process can read",
                f"give {name} the path of a readable PEM file on this host",
            )


def tls_kwargs(tls: RedisTls, variable: str = VARIABLE) -> dict[str, Any]:
    """redis-py's keyword arguments for `tls` (Redis, RedisCluster, Sentinel.master_for and
    the sentinels' own clients, sync or asyncio): `ssl=True` and every ssl_ option, the
    host-name check set explicitly (redis-py before 6 left it off); {} without TLS."""
    if not tls.on:
        return {}
    check_files(tls, variable)
    return {
        "ssl": True,
        "ssl_ca_certs": tls.ca_certs,
        "ssl_certfile": tls.certfile,
        "ssl_keyfile": tls.keyfile,
        "ssl_cert_reqs": tls.cert_reqs,
        "ssl_check_hostname": tls.check_hostname,
    }


_VERIFY = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}


def tls_context(tls: RedisTls, variable: str = VARIABLE) -> ssl.SSLContext | None:
    """An SSLContext for our own sockets (Redlock's), as redis-py builds its own: the CA
    file or the system's, the client certificate, the checks `tls` asks for; None without
    TLS."""
    if not tls.on:
        return None
    check_files(tls, variable)
    ctx = ssl.create_default_context(cafile=tls.ca_certs)
    ctx.check_hostname = tls.check_hostname  # before verify_mode: NONE needs it off
    ctx.verify_mode = _VERIFY[tls.cert_reqs]
    if tls.certfile:
        try:
            ctx.load_cert_chain(tls.certfile, tls.keyfile)
        except (ssl.SSLError, OSError) as exc:
            raise UnsafeSettings(
                variable, f"ssl_certfile={tls.certfile} (with ssl_keyfile) is not a "
                f"certificate and key that match ({type(exc).__name__})",
                "give ssl_certfile the client certificate and ssl_keyfile its private key (PEM)",
            ) from None
    return ctx


def security(tls: RedisTls, *, password: bool) -> Security:
    """`LockBackend.security()` of a Redis-family store: `password` a password (or ACL
    user's) is sent; a client certificate counts as authentication too."""
    return Security(
        tls=tls.on,
        verified=tls.verified,
        hostname_checked=tls.hostname_checked,
        auth=password or bool(tls.on and tls.certfile),
    )


def security_of_kwargs(kwargs: Mapping[str, Any], tls_class: bool) -> Security:
    """`security` read back from a redis-py pool's connection options (a client built by
    the caller rather than from a URL): `tls_class` its connections are SSLConnections."""
    reqs = kwargs.get("ssl_cert_reqs", "required")
    reqs = {ssl.CERT_REQUIRED: "required", ssl.CERT_OPTIONAL: "optional",
            ssl.CERT_NONE: "none"}.get(reqs, str(reqs).lower())  # fmt: skip
    reqs = reqs.removeprefix("cert_")
    tls = RedisTls(
        on=tls_class,
        certfile=kwargs.get("ssl_certfile"),
        cert_reqs=reqs if reqs in _VERIFY else "none",
        check_hostname=bool(kwargs.get("ssl_check_hostname", True)),
    )
    return security(tls, password=bool(kwargs.get("password")))


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def tls_hint(exc: BaseException) -> str | None:
    """What to try when a connection to a Redis server failed in its TLS handshake or its
    login, else None (never quoting a password: the server's own words are not repeated).

    redis-py wraps the cause: a certificate that did not verify is an ssl.SSLError in the
    chain (a wrong host name is told apart from an untrusted CA); a server that wants a
    client certificate sends an alert (TLS 1.3: at the first read); a server speaking plain
    Redis on the port never answers the handshake (timeout) or drops it.
    """
    seen = _chain(exc)
    texts = [str(e).lower() for e in seen]
    if any(m in t for t in texts for m in ("wrongpass", "invalid username-password", "noauth",
                                           "invalid password", "unauthenticated",
                                           "authentication required",
                                           "already authenticated")):  # fmt: skip
        return (
            "the lock server refused the login: check the user and password in the URL "
            "(redis://user:password@host..., percent-encoded; for the sentinels themselves, "
            "?sentinel_password=)"
        )
    return _unverified_hint(seen) or _handshake_hint(seen, texts)


def _unverified_hint(seen: list[BaseException]) -> str | None:
    """The server's certificate did not verify: it names another host, or no trusted CA
    signed it."""
    for e in seen:
        if isinstance(e, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
            why = getattr(e, "verify_message", None) or "untrusted"
            if "mismatch" in why.lower() or "mismatch" in str(e).lower():
                why = why if "mismatch" in why.lower() else "host name mismatch"
                return (
                    f"TLS handshake with the lock server failed: its certificate does not "
                    f"name the host connected to ({why}); connect by a name the certificate "
                    "lists, or give the server a certificate for this name "
                    "(ssl_check_hostname=false turns the check off: a downgrade)"
                )
            return (
                "TLS handshake with the lock server failed: its certificate did not verify "
                f"({why}); {CA_FILE_HINT}"
            )
    return None


def _handshake_hint(seen: list[BaseException], texts: list[str]) -> str | None:
    """The server ended the handshake: it wants a client certificate, refused ours, or
    serves no TLS on the port."""
    if any("certificate required" in t or "alert handshake failure" in t for t in texts):
        return (
            "TLS: the lock server asks for a client certificate and got none it accepts; "
            "pass one in the URL: ssl_certfile=/path/client.crt&ssl_keyfile=/path/client.key"
        )
    eof = any(isinstance(e, ssl.SSLEOFError) or "eof occurred in violation" in t
              for e, t in zip(seen, texts, strict=True))  # fmt: skip
    if eof and any("writing" in t or "set-up" in t for t in texts):
        # Closed by the server right after the handshake, at our first write: what a
        # server that asks for client certificates does to a client without one (TLS 1.3).
        return (
            "TLS: the lock server closed the connection right after the handshake; if it "
            "asks for client certificates (tls-auth-clients yes), pass one in the URL: "
            "ssl_certfile=/path/client.crt&ssl_keyfile=/path/client.key"
        )
    if any("unknown ca" in t or "bad certificate" in t for t in texts):
        return (
            "TLS: the lock server refused this client's certificate (not from a CA it "
            "trusts); give ssl_certfile= a certificate from the server's tls-ca-cert-file CA"
        )
    # Only failures while connecting: an SSL error on an open connection (a server that
    # went away mid-reply) is no handshake problem.
    connecting = any("connecting to" in t or "handshake" in t for t in texts)
    if connecting and any(isinstance(e, ssl.SSLError) or "handshake" in t
                          for e, t in zip(seen, texts, strict=True)):
        return (
            "TLS handshake with the lock server failed: is it serving TLS on this port? "
            f"A plain Redis port needs redis://, not rediss://; {CA_FILE_HINT}"
        )
    return None
