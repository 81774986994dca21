"""What every `python -m jobfence` command shares: `--app` (the project's Celery app, found as
`celery -A` finds it), the settings a command reads and where they came from, argument types."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from typing import Any

from jobfence.config import Settings, load_settings
from jobfence.locks.registry import MissingExtra


def add_app_option(
    parser: argparse.ArgumentParser,
    default: str = "JOBFENCE_* from the environment, and Django settings when "
    "DJANGO_SETTINGS_MODULE names them",
    *,
    inner: bool = False,
) -> None:
    """`--app`: the project whose settings a command reads (every command; the fleet's own
    --app also picks the workers to run). `inner`: on a sub-action, so `locks list --app X` and
    `locks --app X list` both work (argparse would reset the outer value otherwise)."""
    parser.add_argument(
        "--app",
        "-A",
        metavar="MODULE[:ATTR]",
        default=argparse.SUPPRESS if inner else None,
        help="your Celery app, as `celery -A` takes it (e.g. proj.tasks:app, or a Django "
        "project's proj), imported from the current directory; jobfence's settings are then "
        f"the ones its workers read (default: {default})",
    )


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0: float() reads "nan" and "inf" too."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds > 0, got {text!r}; e.g. 30"
        )
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def project_settings(args: argparse.Namespace, lock_url: str | None = None) -> Settings:
    """The settings a command uses: those of `--app`'s workers (its runtime, or JOBFENCE_*
    read once the app, and so its Django settings, are loaded), else JOBFENCE_* and, when
    DJANGO_SETTINGS_MODULE is set, Django settings; `lock_url` (--lock-url) wins."""
    if getattr(args, "app", None):
        from jobfence.tasks.runtime import installed

        runtime = installed(load_app(args.app))
        if runtime is not None and not lock_url:
            return runtime.settings
    return load_settings(lock_url=lock_url) if lock_url else load_settings()


def describe_source(args: argparse.Namespace, settings: Settings, lock_url: str | None) -> str:
    """Which lock server a command talks to and where that came from, without a secret."""
    from jobfence.config.settings import setting_source
    from jobfence.config.urls import redact

    source = "--lock-url" if lock_url else setting_source("lock_url")
    module = os.environ.get("DJANGO_SETTINGS_MODULE")
    app = getattr(args, "app", None)
    read = (f"--app {app}" if app else "no --app") + (
        f", Django settings {module}" if module else ", no DJANGO_SETTINGS_MODULE"
    )
    return f"lock server: {redact(settings.lock_url)} (from {source}; {read})"


def say_source(args: argparse.Namespace, settings: Settings, lock_url: str | None) -> None:
    """Say `describe_source`'s line: on stderr under --json, so the JSON on stdout stays
    parseable."""
    line = describe_source(args, settings, lock_url)
    print(line, file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)


def emit_json(data: Any) -> None:
    """A command's --json output, on stdout."""
    print(json.dumps(data, indent=2, sort_keys=True))


def app_module(spec: str) -> str:
    """The module part of a `celery -A` app spec (`proj.tasks:app` -> `proj.tasks`)."""
    return spec.split(":", 1)[0]


def _cwd_importable() -> None:
    # As `celery -A` does: the app is imported from the directory the command runs in.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def missing_app_module(spec: str) -> str | None:
    """Why `spec`'s module cannot be imported from here (None if it can be found)."""
    _cwd_importable()
    module = app_module(spec)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return (
        f"--app {spec}: no module {module!r} importable from {os.getcwd()}; run from your "
        "project's directory, or give the full dotted path (e.g. proj.tasks:app)"
    )


def load_app(spec: str) -> Any:
    """The Celery app `spec` names, found as `celery -A` finds it."""
    from celery.app.utils import find_app

    missing = missing_app_module(spec)
    if missing:
        raise AppNotFound(missing)
    try:
        return find_app(spec)
    except MissingExtra as exc:  # the app's own set-up needs a library: that first
        raise AppNotFound(f"--app {spec}: {exc}") from None
    except ImportError as exc:
        if exc.name and not app_module(spec).startswith(exc.name):
            raise AppNotFound(f"--app {spec}: importing it failed: {type(exc).__name__}: "
                              f"{exc}") from None  # fmt: skip
        raise AppNotFound(f"--app {spec}: no Celery app found there ({exc})") from None
    except AttributeError as exc:
        raise AppNotFound(f"--app {spec}: no Celery app found there ({exc})") from None


class AppNotFound(LookupError):
    """`--app` names no importable Celery app."""
