"""Small pure helpers the lock backends share: URL option flags and options from settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


def settings_options(settings: Settings) -> dict[str, Any]:
    """The `from_url` keywords a URL-built backend takes from the settings, beside the URL."""
    return {
        "prefix": settings.key_prefix,
        "socket_timeout": settings.socket_timeout,
        "fence_retention": settings.fence_retention,
    }
