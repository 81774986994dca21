"""Redaction of URLs for messages and logs, and the splitting of URL text it relies on."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode

#: Query parameters that carry a credential (redis-py and kombu pass unknown ones through).
SECRET_QUERY = re.compile(r"(pass(word|wd)?|pwd|secret|token|auth|credential|key)", re.I)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_REDACTED = "***"


def has_scheme(url: str) -> bool:
    return bool(_SCHEME.match(url))


def redact(url: str) -> str:
    """`url` without its password (userinfo and credential query parameters), fit for a log line.

    The one redaction of the package: every message, log line and `check` output that shows a
    URL shows it through here. Works on text that is not a valid URL too (a bad port, a
    password holding `/`, `?` or `@`), since that is exactly what error messages show:
    everything between `://` and the last `@` is taken for the userinfo, so a password with an
    unencoded `?` is hidden too (an `@` in a query value then hides a little more than needed,
    never less). Any query parameter whose name holds pass, secret, token, key, auth or
    credential has its value replaced.
    """
    if not url:
        return url
    match = _SCHEME.match(url)
    head, rest = (url[: match.end()], url[match.end() :]) if match else ("", url)
    at = _userinfo_end(rest)
    if at >= 0:
        userinfo, rest = rest[:at], rest[at + 1 :]
        user, colon, _ = userinfo.partition(":")
        # With no ':' the userinfo is a user name, or (some services) a bare token: hide a
        # bare token too, unless it looks like a plain user name.
        shown = f"{user}:{_REDACTED}" if colon else (user if user.isidentifier() else _REDACTED)
        rest = f"{shown}@{rest}"
    q = rest.find("?")
    if q >= 0:
        frag = rest.find("#", q)
        query = rest[q + 1 : frag if frag >= 0 else len(rest)]
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(SECRET_QUERY.search(k) for k, _ in pairs):
            clean = [(k, _REDACTED if SECRET_QUERY.search(k) else v) for k, v in pairs]
            tail = rest[frag:] if frag >= 0 else ""
            rest = rest[: q + 1] + urlencode(clean, safe="*/:") + tail
    return head + rest


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]+)(:[0-9]+)?$")


def _plain_authority(text: str) -> bool:
    """Whether `text` (a URL after its scheme, before its '?') is hosts and a path with no
    userinfo: then an '@' after the '?' is in the query, not the end of a password."""
    authority, slash, _ = text.partition("/")
    return bool(slash) and all(_HOST_PORT.match(part) for part in authority.split(","))


def _userinfo_end(rest: str) -> int:
    """Index of the '@' that ends the userinfo in `rest` (a URL after `://`), or -1: the last
    '@', unless the text before the first '?' is plainly hosts and a path (then an '@' after
    it is in a query value)."""
    at = rest.rfind("@")
    q = rest.find("?")
    if 0 <= q < at and _plain_authority(rest[:q]):
        at = rest.rfind("@", 0, q)
    return at


def split_userinfo(url: str) -> tuple[str, str]:
    """(userinfo, the rest after it) of a URL with a scheme, the way `redact` splits it."""
    rest = url.split("://", 1)[1]
    at = _userinfo_end(rest)
    return (rest[:at], rest[at + 1 :]) if at >= 0 else ("", rest)


def _authority(url: str) -> str:
    rest = split_userinfo(url)[1]
    for sep in "/?#":
        rest = rest.split(sep, 1)[0]
    return rest


def host_port(url: str) -> tuple[str, str]:
    """(host, port text) of `url`'s authority; either may be empty."""
    hostport = _authority(url)
    if hostport.startswith("["):  # [::1]:6379
        close = hostport.find("]")
        return hostport[: close + 1], hostport[close + 1 :].removeprefix(":")
    host, colon, port = hostport.rpartition(":")
    return (host, port) if colon else (hostport, "")


def port_problem(url: str) -> str | None:
    """Why the port of `url` is unusable, or None (also None when it has no port)."""
    host, port = host_port(url)
    if host.startswith("[") and not host.endswith("]"):
        return "has an unclosed '[' in its host"
    if not port:
        return None
    if not port.isdigit():
        return f"has port {port!r}, which is not a number"
    if not 0 < int(port) < 65536:
        return f"has port {port}, outside 1-65535"
    return None
