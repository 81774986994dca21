"""Settings and the error root for jobfence."""

from jobfence.config.errors import JobfenceError, UnsafeSettings
from jobfence.config.settings import InsecureSettingsWarning, Settings, load_settings
from jobfence.config.urls import redact

__all__ = [
    "InsecureSettingsWarning",
    "JobfenceError",
    "Settings",
    "UnsafeSettings",
    "load_settings",
    "redact",
]
