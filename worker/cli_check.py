"""`python -m jobfence check`: the start-up checks a worker of the app runs, with every finding,
the lock server's health and the security posture, against the configured servers."""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace
from typing import Any

from jobfence.config import UnsafeSettings, load_settings
from jobfence.config.errors import EX_CONFIG, InsecureSettings
from jobfence.locks.registry import MissingExtra
from jobfence.worker.cli_common import AppNotFound, add_app_option, describe_source, load_app


def add_check_parser(sub: Any) -> None:
    """The `check` command."""
    check = sub.add_parser(
        "check",
        help="run the start-up checks against the configured servers",
        description="Run the checks a worker of the app runs at start (serialisers, eviction "
        "policy of the lock server and a Redis broker, TTLs against the visibility timeout) "
        "and list every finding. Exit status 78 (EX_CONFIG, as a refused worker) if any "
        "refuses or the settings cannot be read; 0 if they pass, warnings included.",
    )
    add_app_option(check, default="create_app() from JOBFENCE_*: settings, no tasks")


def cmd_check(args: argparse.Namespace) -> int:
    from jobfence.tasks import runtime_for

    app, status = _app_to_check(args)
    if status is not None:
        return status
    app.loader.import_default_modules()  # the task modules, as a worker imports them
    try:
        runtime = runtime_for(app)  # built from JOBFENCE_* if the app has none yet
    except InsecureSettings as exc:
        return _refused_before_connecting(app.conf, None, exc)
    except (UnsafeSettings, MissingExtra) as exc:
        from jobfence.worker.checks import refusal_text

        print(f"REFUSED: jobfence's settings cannot be read:\n{refusal_text(exc)}")
        print("start-up checks: refused")
        return EX_CONFIG
    print(describe_source(args, runtime.settings, None))
    try:
        findings = _check_with_servers(app, runtime)
    finally:
        runtime.close()
    return _report(findings)


def _app_to_check(args: argparse.Namespace) -> tuple[Any, int | None]:
    """(`--app`'s Celery app, or one create_app() makes from JOBFENCE_*; None) or, where there
    is none to check, (None, the exit status, said why)."""
    if args.app:
        from jobfence.worker.setup import is_set_up

        try:
            app = load_app(args.app)
        except AppNotFound as exc:
            print(f"jobfence: {exc}", file=sys.stderr)
            return None, 2
        print(f"app: {args.app}")
        if not is_set_up(app):
            print(
                f"note: {args.app} is not set up with jobfence.setup(app): its workers do not "
                "run these checks at start, and its Celery settings are its own"
            )
        return app, None
    from jobfence.worker.app import create_app

    print("app: none given: create_app() from JOBFENCE_* (settings only, no tasks)")
    settings = load_settings()
    try:
        return create_app(settings), None
    except InsecureSettings as exc:
        return None, _refused_before_connecting(None, settings, exc)


def _check_with_servers(app: Any, runtime: Any) -> list[Any]:
    """The lock backend's health and the security posture, said; then every finding."""
    from jobfence.worker.checks import lock_security, posture_lines, run_checks

    health = runtime.backend.health()
    state = "ok" if health.ok else "NOT ANSWERING"
    print(f"health of the {runtime.backend.name} lock backend: {state} in "
          f"{health.latency * 1000:.1f} ms ({health.detail})")  # fmt: skip
    print("security posture:")
    for line in posture_lines(app.conf, runtime.settings, lock_security(runtime)):
        print(f"  {line}")
    return run_checks(app, runtime)


def _report(findings: list[Any]) -> int:
    """What was checked and what was found; EX_CONFIG if any finding refuses, else 0."""
    from jobfence.worker.checks import CHECKED

    print("checked:")
    for name, what, _ in CHECKED:
        print(f"  {name}: {what}")
    for f in findings:
        print(f"{'REFUSED' if f.refuse else 'warning'}: {f}")
    refused = any(f.refuse for f in findings)
    print("start-up checks: " + ("refused" if refused else "passed"))
    return EX_CONFIG if refused else 0


def _refused_before_connecting(conf: Any, settings: Any, exc: InsecureSettings) -> int:
    """`check` on settings refused before any connection: their posture (judged from the
    text alone) and each refusal; the lock server is never opened (its password stays)."""
    from jobfence.worker.checks import posture_lines

    if settings is None:
        try:
            settings = load_settings()
        except (UnsafeSettings, MissingExtra):
            settings = None
    if settings is not None:
        empty = SimpleNamespace(broker_url=None, result_backend=None)
        print("security posture:")
        for line in posture_lines(conf if conf is not None else empty, settings):
            print(f"  {line}")
    for refusal in (exc, *exc.also):
        print(f"REFUSED: {refusal.field}: {refusal.problem}. Fix: {refusal.fix}")
    print("the lock server was not opened: the settings are refused before any connection")
    print("start-up checks: refused")
    return EX_CONFIG
