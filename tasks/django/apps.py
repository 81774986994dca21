"""The Django app config of jobfence: label ``jobfence``, tables by migration, a settings check."""

from __future__ import annotations

import sys
from typing import Any

from django.apps import AppConfig
from django.core import checks

CHECK_COMMAND = "django.core.management.commands.check"


class JobfenceConfig(AppConfig):  # type: ignore[misc]
    name = "jobfence.tasks.django"
    label = "jobfence"
    verbose_name = "jobfence"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        checks.register(check_settings, "jobfence")


def check_command_running() -> bool:
    """Whether Django's ``check`` command (``manage.py check``, or the test runner's call of
    it) is what runs the system checks now."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == CHECK_COMMAND:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def message(number: int, text: str, hint: str, *, refuse: bool) -> Any:
    """A refusal is an Error under ``manage.py check`` and a Warning (same text) under every
    other command: a setting only workers use must not stop ``migrate`` or ``runserver``."""
    if refuse and check_command_running():
        return checks.Error(text, hint=hint, id=f"jobfence.E{number:03d}")
    return checks.Warning(
        text + (" (workers and beat refuse to start with it)" if refuse else ""),
        hint=hint,
        id=f"jobfence.W{number:03d}",
    )


def check_settings(app_configs: Any = None, **_: Any) -> list[Any]:
    """``manage.py check``: jobfence's Settings (env and JOBFENCE_* in settings.py) are valid,
    and no JOBFENCE_* name in settings.py is a typo. The same rules as a worker's start."""
    from jobfence.config.errors import SETTINGS_FIX, UnsafeSettings
    from jobfence.config.settings import load_settings, unknown_django_settings

    found = []
    try:
        load_settings()
    except UnsafeSettings as exc:
        for problem in (exc, *exc.also):
            found.append(message(1, f"{problem.field}: {problem.problem}",
                                 f"{problem.fix} (in the environment or in settings.py)",
                                 refuse=True))  # fmt: skip
    for name, close in unknown_django_settings():
        fix = f"did you mean {close}?" if close else SETTINGS_FIX
        found.append(message(3, f"{name} (in Django settings): is not a jobfence setting, so "
                                "it is ignored", fix, refuse=False))  # fmt: skip
    return found
