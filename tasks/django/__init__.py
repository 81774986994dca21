"""jobfence for Django: settings from settings.py, fenced effects on Django's own connection.

Add ``"jobfence.tasks.django"`` to ``INSTALLED_APPS`` (app label ``jobfence``) and run
``manage.py migrate``. ``import jobfence`` never imports this package; importing it
imports Django but touches no database.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobfence.tasks.django.effects import DjangoEffects, DjangoEffectTx, django_effects
    from jobfence.tasks.django.guard import DjangoFenceGuard, NotMigrated, fence_guard

__all__ = [
    "DjangoEffectTx",
    "DjangoEffects",
    "DjangoFenceGuard",
    "NotMigrated",
    "django_effects",
    "fence_guard",
]

_EXPORTS = {
    "DjangoEffectTx": "jobfence.tasks.django.effects",
    "DjangoEffects": "jobfence.tasks.django.effects",
    "django_effects": "jobfence.tasks.django.effects",
    "DjangoFenceGuard": "jobfence.tasks.django.guard",
    "fence_guard": "jobfence.tasks.django.guard",
    "NotMigrated": "jobfence.tasks.django.guard",
}


def __getattr__(name: str) -> Any:
    # Lazy, so INSTALLED_APPS can import the package before the app registry is ready.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    try:
        return getattr(import_module(module), name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "django":
            raise
        from jobfence.locks.registry import MissingExtra

        raise MissingExtra(
            f"jobfence.tasks.django needs Django: pip install 'jobfence[django]' ({exc.name} "
            "is missing)",
            name=exc.name,
        ) from exc
