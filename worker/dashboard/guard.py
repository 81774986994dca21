"""Who may reach the dashboard: the Host allow-list (against DNS rebinding) and the token login."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
import urllib.parse
from collections.abc import Iterable

TOKEN_ENV = "JOBFENCE_DASHBOARD_TOKEN"
MIN_TOKEN = 32  # characters: `secrets.token_urlsafe(32)` gives 43
LOGIN_COOKIE = "jobfence_dash_login"
LOGIN_TTL = 12 * 3600.0  # seconds a login lasts
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # any port: a rebinding page is elsewhere
MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class GuardError(ValueError):
    """A dashboard set up without what its exposure needs (a token, a usable Host name)."""


def split_host(value: str) -> tuple[str, str]:
    """(name, port) of a Host header or allow-list entry, lower-cased; port "" when absent.
    An IPv6 address keeps its brackets: "[::1]:8099" -> ("[::1]", "8099")."""
    value = value.strip().lower().rstrip(".")
    if value.startswith("["):
        name, _, rest = value.partition("]")
        return name + "]", rest[1:] if rest.startswith(":") else ""
    if value.count(":") == 1:
        name, _, port = value.partition(":")
        return name, port
    return value, ""


def host_entry(value: str) -> str:
    """An allow-list entry checked: a host name or address, with a port or not."""
    name, port = split_host(value)
    if not name or "/" in value or (port and not port.isdigit()) or any(c in name for c in " @"):
        raise GuardError(
            f"--allowed-host {value!r} is not a host name: give the name (or name:port) you "
            f"browse the dashboard by, e.g. dash.example.com"
        )
    return f"{name}:{port}" if port else name


def url_host(address: str, port: int) -> str:
    """The Host a browser sends for a bound address and port ("::1" -> "[::1]:8099")."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def is_loopback(address: str) -> bool:
    if address.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


class HostList:
    """The Host values a dashboard answers to: an entry with a port matches exactly, one
    without matches that name on any port (a proxy on 443 sends the bare name)."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = tuple(dict.fromkeys(host_entry(e) for e in entries))
        if not self.entries:
            raise GuardError("the dashboard's allowed hosts are empty: it would answer nobody")

    def allows(self, host: str) -> bool:
        name, port = split_host(host)
        if not name:
            return False
        return any(
            (e_name == name and (not e_port or e_port == port))
            for e_name, e_port in map(split_host, self.entries)
        )

    def allows_origin(self, origin: str) -> bool:
        """Whether an Origin header (scheme://host[:port]) names an allowed host; "null" and
        anything unparsable do not. A port the scheme implies counts as given."""
        parts = urllib.parse.urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        if self.allows(parts.netloc):
            return True
        default = "443" if parts.scheme == "https" else "80"
        return parts.port is None and self.allows(f"{parts.netloc}:{default}")


def check_token(token: str | None) -> str | None:
    """The token from the environment, checked: None when unset; a weak one is refused."""
    if token is None or token == "":
        return None
    if len(token) < MIN_TOKEN or len(set(token)) < 8:
        raise GuardError(
            f"{TOKEN_ENV} is too weak ({len(token)} characters; at least {MIN_TOKEN}, random): "
            f"make one with {MAKE_TOKEN}"
        )
    return token


class Login:
    """The token check: a bearer header, or a login cookie the login form sets. The cookie is
    an HMAC under a key derived from the token (never the token): it lasts `LOGIN_TTL`, and
    changing the token logs everybody out."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._key = hashlib.sha256(b"jobfence dashboard login\n" + self._token).digest()

    def __repr__(self) -> str:
        return "Login(<token hidden>)"

    def token_matches(self, offered: str) -> bool:
        return hmac.compare_digest(offered.encode(), self._token)

    def bearer_ok(self, authorization: str) -> bool:
        scheme, _, value = authorization.partition(" ")
        return scheme.lower() == "bearer" and self.token_matches(value.strip())

    def mint_cookie(self) -> str:
        issued = str(int(time.time()))  # floored: never ahead of the check's clock
        return f"{issued}.{self._mac(issued)}"

    def cookie_ok(self, cookie: str) -> bool:
        issued, _, mac = cookie.partition(".")
        if not issued.isdigit() or not hmac.compare_digest(mac, self._mac(issued)):
            return False
        return 0 <= time.time() - int(issued) <= LOGIN_TTL

    def _mac(self, issued: str) -> str:
        return hmac.new(self._key, f"login\n{issued}".encode(), hashlib.sha256).hexdigest()
