"""The worker's start-up checks as a Django system check, for an app set up in a Django project.

``jobfence.setup(app)`` registers it when the process uses Django: ``manage.py check``
then refuses exactly what a worker of the app refuses (the same ``run_checks``, talking to
the lock server and a Redis broker as a worker does), and every other command shows the
same findings as warnings without talking to a server. Settings that cannot be read at all
are reported by the ``jobfence`` app's own check (tasks/django/apps.py).
"""

from __future__ import annotations

from typing import Any

from jobfence.config import UnsafeSettings
from jobfence.config.settings import ENV_PREFIX
from jobfence.locks.registry import MissingExtra
from jobfence.tasks.runtime import installed

_running: list[Any] = []  # the app whose checks run now, if any (no re-entry)


def register(app: Any) -> None:
    """Add the start-up checks of `app` to Django's check framework (once per app)."""
    from django.core import checks

    def startup_checks(app_configs: Any = None, **_: Any) -> list[Any]:
        return django_findings(app)

    checks.register(startup_checks, "jobfence")


def django_findings(app: Any) -> list[Any]:
    """`run_checks` of `app` as Django check messages (E002/W002 refusals, W004 warnings)."""
    from jobfence.tasks.django.apps import check_command_running, message
    from jobfence.worker.checks import UNKNOWN_NAME, run_checks

    runtime = installed(app)
    if runtime is None:  # setup could not build it: a missing extra is named here,
        error = getattr(app, "jobfence_unsettled", None)  # unusable settings by the app's check
        if isinstance(error, MissingExtra):
            return [message(2, f"{ENV_PREFIX}LOCK_URL: {error}", "install the extra, or use "
                            "another lock URL", refuse=True)]  # fmt: skip
        return []
    if _running:  # Celery's Django fixup runs the system checks while importing tasks
        return []
    _running.append(app)
    try:
        app.loader.import_default_modules()  # the task modules, as a worker imports them
        findings = run_checks(app, runtime, servers=check_command_running())
    except (UnsafeSettings, MissingExtra) as exc:
        return [message(2, str(exc), "see docs/reference/settings.md", refuse=True)]
    finally:
        _running.clear()
    return [
        message(2 if f.refuse else 4, f"{f.setting}: {f.problem}", f.fix, refuse=f.refuse)
        for f in findings
        if f.code != UNKNOWN_NAME  # the jobfence app's check reports the typos
    ]
