"""Settings and the error root for jobfence."""

from config.errors import JobfenceError, UnsafeSettings
from config.settings import InsecureSettingsWarning, Settings, load_settings

__all__ = [
    "InsecureSettingsWarning",
    "JobfenceError",
    "Settings",
    "UnsafeSettings",
    "load_settings",
]
