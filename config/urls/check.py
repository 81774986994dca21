"""The checks of a one-host URL: any server's (a scheme, a numeric port, no '/' in the
password), a lock backend's with none of its own, and a MySQL/MariaDB lock URL's."""

from __future__ import annotations

from collections.abc import Callable

from jobfence.config.errors import UnsafeSettings
from jobfence.config.urls.redact import has_scheme, port_problem, redact, split_userinfo

#: A lock URL check: raises UnsafeSettings naming the variable (its second argument).
UrlCheck = Callable[[str, str], object]

LOCK_EXAMPLE = "redis://127.0.0.1:6379/0 (TLS: rediss://host:6380/0)"


def check_url(
    url: str, *, variable: str, schemes: tuple[str, ...] | None, example: str, what: str
) -> None:
    """Raise UnsafeSettings (one line: variable, problem, an example) if `url` is unusable.

    `schemes` None accepts any scheme (broker and database URLs: kombu and SQLAlchemy
    have many); `what` names the server in the message.
    """
    fix = f"set {variable} to a URL such as {example}"
    shown = redact(url)
    if not has_scheme(url):
        raise UnsafeSettings(variable, f"{shown!r} has no scheme (scheme://host:port)", fix)
    scheme = url.split("://", 1)[0].lower()
    if schemes is not None and scheme not in schemes:
        raise UnsafeSettings(
            variable,
            f"scheme {scheme!r} is not a {what} jobfence supports "
            f"(use {', '.join(s + '://' for s in schemes)})",
            fix,
        )
    if any(c in split_userinfo(url)[0] for c in "/#?"):
        raise UnsafeSettings(
            variable,
            f"{shown!r} has '/', '?' or '#' in its user name or password, which clients read "
            "as the end of the host part",
            "percent-encode them in the URL (/ as %2F, ? as %3F, # as %23, @ as %40)",
        )
    port = port_problem(url)
    if port:
        raise UnsafeSettings(variable, f"{shown!r} {port}", fix)


def check_one_host(url: str, variable: str) -> None:
    """The lock URL checks of a backend with none of its own: a host, a numeric port, no '/'
    or '#' in the password."""
    check_url(url, variable=variable, schemes=None, example=LOCK_EXAMPLE, what="lock backend")


def check_mysql_url(url: str, variable: str) -> None:
    """mysql://, mariadb://, mysql+pymysql://: the one-host checks and a database name."""
    check_url(url, variable=variable, schemes=None, example=LOCK_EXAMPLE, what="lock backend")
    if not url.split("://", 1)[1].split("?", 1)[0].partition("/")[2].strip("/"):
        raise UnsafeSettings(
            variable, f"{redact(url)!r} names no database",
            f"set {variable} to a URL such as mysql://user:password@127.0.0.1:3306/jobfence",
        )
