"""The dashboard's requests and responses as its pages see them (the ASGI and Django shells
translate to and from them), and the small responses and template filters every page uses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime


@dataclass(frozen=True)
class Request:
    """What a page needs of an HTTP request. `root` is where the dashboard is mounted."""

    method: str
    path: str  # below root: "/", "/lock", ...
    query: Mapping[str, str] = field(default_factory=dict)
    form: Mapping[str, str] = field(default_factory=dict)
    cookies: Mapping[str, str] = field(default_factory=dict)
    origin: str = ""  # the Origin header, if the browser sent one
    host: str = ""  # the Host header
    root: str = ""
    user: str = "anonymous"  # who acts, for the action log (Django: the admin user)
    csrf_input: str = ""  # a shell's own CSRF field (Django's), put into every form
    authorization: str = ""  # the Authorization header ("Bearer <token>")
    host_checked: bool = False  # the shell vetted the Host (Django's ALLOWED_HOSTS)
    authenticated: bool = False  # the shell's own login passed (Django's staff login)


@dataclass
class Response:
    """What a page answers; the shell writes it out (cookies HttpOnly, SameSite=Strict)."""

    status: int
    body: str
    content_type: str = "text/html; charset=utf-8"
    set_cookie: tuple[str, str] | None = None  # (name, value), HttpOnly, SameSite=Strict
    login_cookie: str | None = None  # set it (HttpOnly, SameSite=Strict); "" clears it
    headers: dict[str, str] = field(default_factory=dict)


def plain(status: int, text: str) -> Response:
    """A refusal before the login: plain text, nothing of the lock server in it."""
    return Response(status, text + "\n", "text/plain; charset=utf-8")


def safe_next(nxt: str) -> str:
    """A page below the dashboard's root to go on to after the login; "/" for anything else
    (another site, a scheme, a backslash or control character)."""
    if not nxt.startswith("/") or nxt.startswith("//") or any(c in nxt for c in "\\\r\n\t"):
        return "/"
    return nxt


def redirect(req: Request, below_root: str) -> Response:
    """A 303 to a page below the dashboard's root."""
    return Response(303, "", headers={"Location": (req.root or "") + below_root})


def when(epoch: float) -> str:
    """Template filter: an epoch time as UTC, "-" for none."""
    if not epoch:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def secs(value: float | None) -> str:
    """Template filter: seconds to a tenth, "-" for none."""
    return "-" if value is None else f"{value:.1f}s"
