"""A pydantic-settings source reading JOBFENCE_* names from Django settings, when Django is set up.

Precedence (highest first): keyword arguments, the environment, the ``.env`` file, Django
settings, secret files, then the defaults. ``settings.py`` is code: the same file ships to
every deployment, and an operator must be able to override one value for one machine
(``JOBFENCE_LOCK_URL=... celery worker``) without editing it, as Django projects already do
for their own settings with ``os.environ``.

Django is never imported here unless the process already uses it: ``django.conf`` is in
``sys.modules``, or ``DJANGO_SETTINGS_MODULE`` names a settings module.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from jobfence.config.errors import SETTINGS_FIX, UnsafeSettings


class UnknownDjangoSetting(UserWarning):
    """A JOBFENCE_* name in Django settings that no jobfence setting has (a typo, usually)."""


def django_settings() -> Any | None:
    """``django.conf.settings`` if this process uses Django and it is configured, else None."""
    if "django.conf" not in sys.modules and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return None
    try:
        from django.conf import settings
    except ImportError:  # DJANGO_SETTINGS_MODULE set, Django not installed: nothing to read
        return None
    module = os.environ.get("DJANGO_SETTINGS_MODULE")
    if not settings.configured and not module:
        return None
    try:
        settings.INSTALLED_APPS  # noqa: B018 -- loads the settings module now, once
    except Exception as exc:
        # Only an ImportError's text (a module name) is shown: settings.py may hold secrets.
        why = f"{type(exc).__name__}: {exc}" if isinstance(exc, ImportError) else type(exc).__name__
        raise UnsafeSettings(
            "DJANGO_SETTINGS_MODULE",
            f"Django settings {module!r} (read for JOBFENCE_* names) fail to load: {why}",
            "put the Django project on PYTHONPATH, or unset DJANGO_SETTINGS_MODULE",
        ) from None
    return settings


#: (name, closest known name or None) of each unread JOBFENCE_* name in Django settings.
Unknown = Callable[[], list[tuple[str, str | None]]]


class DjangoSettingsSource(PydanticBaseSettingsSource):
    """``JOBFENCE_LOCK_URL = "redis://..."`` in settings.py feeds ``Settings.lock_url``."""

    def __init__(self, settings_cls: type[BaseSettings], unknown: Unknown | None = None) -> None:
        super().__init__(settings_cls)
        self.prefix = str(self.config.get("env_prefix") or "")
        self.unknown = unknown

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        name = f"{self.prefix}{field_name}".upper()
        conf = django_settings()
        if conf is None or not hasattr(conf, name):
            return None, name, False
        return getattr(conf, name), name, False

    def __call__(self) -> dict[str, Any]:
        conf = django_settings()
        if conf is None:
            return {}
        values: dict[str, Any] = {}
        for field_name, field in self.settings_cls.model_fields.items():
            value, name, _ = self.get_field_value(field, field_name)
            if hasattr(conf, name):  # None in settings.py is a value too
                values[field_name] = value
        if self.prefix and self.unknown is not None:
            for name, close in self.unknown():
                fix = f"did you mean {close}?" if close else SETTINGS_FIX
                warnings.warn(
                    f"{name} (in Django settings): is not a jobfence setting, so it is "
                    f"ignored. Fix: {fix}",
                    UnknownDjangoSetting,
                    stacklevel=_outside_pydantic(),
                )
        return values

    def __repr__(self) -> str:
        return f"{type(self).__name__}(prefix={self.prefix!r})"


def _outside_pydantic() -> int:
    """The stack level of the first caller outside pydantic and this package's settings
    modules, so a warning names the line that built the Settings, not pydantic's."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
        ("pydantic", "jobfence.config")
    ):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def django_sources(
    settings_cls: type[BaseSettings], unknown: Unknown | None = None
) -> tuple[PydanticBaseSettingsSource, ...]:
    """The sources to place between the ``.env`` file and secret files; `unknown` lists the
    JOBFENCE_* names in Django settings that jobfence never reads, each warned about (passed
    in by config/settings.py, which knows the names: importing it here would be a cycle)."""
    return (DjangoSettingsSource(settings_cls, unknown),)
