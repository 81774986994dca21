"""Small helpers the lock backends share: URL option flags, options from settings, and the
start-up finding of a lock server that states its own problems (`server_problems`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from jobfence.config.findings import LOCK_SERVER_DOWN, Finding, LockTarget, refuse
from jobfence.config.urls import redact
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable

if TYPE_CHECKING:  # only a type here: the backends that parse flags need no settings
    from jobfence.config.settings import Settings

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def flag_value(value: str) -> bool | None:
    """A URL option's yes/no spelling as a bool; None where it is neither (the caller says why)."""
    low = value.strip().lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    return None


#: Seconds a key's last fence is kept after its last use, by default, on every backend
#: that prunes it (a later grant's fence is above it anyway: the server's µs clock).
FENCE_RETENTION = 30 * 24 * 3600.0


class UrlOptions(TypedDict, total=False):
    """The keywords every backend's `from_url` takes beside the URL (`open_backend` passes
    them through), declared once; a backend adds its own in a subclass of this."""

    prefix: str  # every key's first segment (default "jobfence")
    socket_timeout: float  # seconds a call to the server may take (default 2.0)
    fence_retention: float | None  # seconds a key's last fence is kept (None: FENCE_RETENTION)
    clock: Clock


class PrunedUrlOptions(UrlOptions, total=False):
    """`UrlOptions` and how often a backend that prunes its dead keys' rows or nodes does it."""

    prune_interval: float  # seconds between prunes (default: the backend's PRUNE_INTERVAL)


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """`UrlOptions` with their defaults filled in, as a backend's `from_url` reads them."""

    prefix: str = "jobfence"
    socket_timeout: float = 2.0
    fence_retention: float = FENCE_RETENTION
    clock: Clock = SYSTEM_CLOCK


def url_options(options: UrlOptions) -> BackendOptions:
    """The common keywords of a `from_url` call, defaults filled in (a backend's own extra
    keywords are read from `options` by that backend)."""
    retention = options.get("fence_retention")
    return BackendOptions(
        prefix=options.get("prefix", "jobfence"),
        socket_timeout=options.get("socket_timeout", 2.0),
        fence_retention=FENCE_RETENTION if retention is None else retention,
        clock=options.get("clock", SYSTEM_CLOCK),
    )


class SettingsOptions(TypedDict):
    """The keywords (typed, so each `from_url` is checked against them)."""

    prefix: str
    socket_timeout: float
    fence_retention: float


def settings_options(settings: Settings) -> SettingsOptions:
    """The `from_url` keywords a URL-built backend takes from the settings, beside the URL."""
    return {
        "prefix": settings.key_prefix,
        "socket_timeout": settings.socket_timeout,
        "fence_retention": settings.fence_retention,
    }


def server_findings(
    target: LockTarget,
    problems: Callable[[], Sequence[tuple[str, str]]],
    foreign: Callable[[], Finding | None] | None = None,
) -> Iterator[Finding]:
    """A lock server whose version or state makes every grant fail (`problems()`, its
    backend's `server_problems`: (problem, fix) pairs); or one that does not answer: an
    outage to wait out, unless `foreign()` refuses the other server answering at its address."""
    try:
        found = problems()
    except BackendUnavailable as exc:
        refusal = foreign() if foreign is not None else None
        if refusal is not None:
            yield refusal
            return
        yield Finding(
            False,
            target.setting,
            f"cannot reach the lock server at {redact(target.url)} at start-up ({exc}); "
            "starting anyway: jobs wait and are redelivered until it answers",
            "start the database, or fix the URL if it is wrong",
            code=LOCK_SERVER_DOWN,
        )
        return
    for problem, fix in found:
        yield refuse(target.setting, problem, fix)
