"""Settings and the error root for jobfence (pydantic is imported with Settings, on first use)."""

from typing import TYPE_CHECKING

from jobfence.lazy import lazy_exports

if TYPE_CHECKING:
    from jobfence.config.errors import JobfenceError, UnsafeSettings
    from jobfence.config.settings import InsecureSettingsWarning, Settings, load_settings
    from jobfence.config.urls import redact

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "JobfenceError": "jobfence.config.errors",
        "UnsafeSettings": "jobfence.config.errors",
        "InsecureSettingsWarning": "jobfence.config.settings",
        "Settings": "jobfence.config.settings",
        "load_settings": "jobfence.config.settings",
        "redact": "jobfence.config.urls",
    },
)

__all__ = [
    "InsecureSettingsWarning",
    "JobfenceError",
    "Settings",
    "UnsafeSettings",
    "load_settings",
    "redact",
]
