"""Small pure helpers the lock backends share: URL option flags and options from settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

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
