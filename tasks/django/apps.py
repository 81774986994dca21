"""The Django app config of jobfence: label ``jobfence``, tables by migration, a settings check."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks


class JobfenceConfig(AppConfig):  # type: ignore[misc]
    name = "jobfence.tasks.django"
    label = "jobfence"
    verbose_name = "jobfence"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        checks.register(check_settings, "jobfence")


def check_settings(app_configs: Any = None, **_: Any) -> list[Any]:
    """``manage.py check``: jobfence's Settings (env and JOBFENCE_* in settings.py) are valid."""
    from jobfence.config.errors import UnsafeSettings
    from jobfence.config.settings import load_settings

    try:
        load_settings()
    except UnsafeSettings as exc:
        return [
            checks.Error(
                f"{exc.field}: {exc.problem}",
                hint=f"{exc.fix} (in the environment or in settings.py)",
                id="jobfence.E001",
            )
        ]
    return []
