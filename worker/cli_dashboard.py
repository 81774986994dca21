"""`python -m jobfence dashboard`: serve the lock dashboard standalone (uvicorn), guarded by
its Host allow-list and, off loopback or with actions, a login token."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jobfence.config import Settings
from jobfence.config.errors import EX_CONFIG
from jobfence.worker.cli_common import (
    AppNotFound,
    load_app,
    positive_int,
    project_settings,
    say_source,
)


def add_dashboard_parser(sub: Any) -> None:
    """The `dashboard` command."""
    dash = sub.add_parser(
        "dashboard",
        help="a web page of the locks, their holders' liveness, slots, leaders and records",
        description="Serve the lock dashboard (pip install 'jobfence[dashboard]'). It binds "
        "127.0.0.1 unless --host says otherwise, is read-only unless --allow-actions, and "
        "answers only the Host names it is bound to (localhost:PORT, --allowed-host). With "
        "JOBFENCE_DASHBOARD_TOKEN set (32+ random characters) every page needs it (a login "
        "form, or an `Authorization: Bearer` header); binding another address or "
        "--allow-actions is refused without it.",
    )
    where = dash.add_mutually_exclusive_group()
    where.add_argument(
        "--app",
        "-A",
        metavar="MODULE[:ATTR]",
        help="your Celery app (its lock settings, its tasks' job keys for finding a job by "
        "its arguments, and its beat schedule)",
    )
    where.add_argument("--lock-url", help="the lock server's URL (default: JOBFENCE_LOCK_URL)")
    dash.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    dash.add_argument("--port", type=positive_int, default=8099, help="port (default 8099)")
    dash.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME[:PORT]",
        help="a Host name the dashboard answers besides its address and localhost:PORT "
        "(the name you browse it by; repeat for more); others get 421",
    )
    dash.add_argument(
        "--allow-actions",
        action="store_true",
        help="enable releasing a provably dead holder's lock (confirmed, logged)",
    )
    dash.add_argument(
        "--metrics-url",
        default="",
        help="a worker's /metrics URL for the live waits, skips and lost leases",
    )
    dash.add_argument(
        "--hide-lock-names",
        action="store_true",
        help="show plain locks (no task) by a hash, not by the name their owner gave them "
        "(`locks list` shows the name)",
    )


def cmd_dashboard(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from jobfence.worker.dashboard.asgi import build_app
        from jobfence.worker.dashboard.core import Dashboard
    except ImportError as exc:
        print(f"jobfence: the dashboard needs its extra: pip install 'jobfence[dashboard]' "
              f"({exc.name} is missing)", file=sys.stderr)  # fmt: skip
        return 2
    from jobfence.worker import admin
    from jobfence.worker.dashboard import guard

    try:
        hosts, token = _dashboard_guard(args)
    except guard.GuardError as exc:
        print(f"jobfence: refusing to start the dashboard: {exc}", file=sys.stderr)
        return EX_CONFIG
    try:
        app, settings = _dashboard_settings(args)
    except AppNotFound as exc:
        print(f"jobfence: {exc}", file=sys.stderr)
        return 2
    say_source(args, settings, args.lock_url)
    backend = admin.open_admin_backend(settings)
    dashboard = Dashboard(backend, actions=args.allow_actions, app=app,
                          metrics_url=args.metrics_url, allowed_hosts=hosts,
                          token=token, hide_names=args.hide_lock_names)  # fmt: skip
    _say_where(args, backend.name, dashboard.hosts.entries, token)
    try:
        uvicorn.run(build_app(dashboard), host=args.host, port=args.port, log_level="warning")
    finally:
        backend.close()
    return 0


def _dashboard_settings(args: argparse.Namespace) -> tuple[Any, Settings]:
    """`--app`'s Celery app (None without one) and the settings the dashboard reads: its
    workers', else JOBFENCE_* (and Django settings), `--lock-url` winning."""
    if args.app:
        from jobfence.tasks import runtime_for

        app = load_app(args.app)
        return app, runtime_for(app).settings
    return None, project_settings(args, args.lock_url)


def _say_where(
    args: argparse.Namespace, backend: str, answers: tuple[str, ...], token: str | None
) -> None:
    """Where the dashboard is served, over which lock backend, how guarded."""
    from jobfence.worker.dashboard import guard

    mode = "actions enabled" if args.allow_actions else "read-only"
    login = "token login" if token else "no login"
    print(f"jobfence dashboard on http://{guard.url_host(args.host, args.port)}/ ({backend}, "
          f"{mode}, {login}; answers Host {', '.join(answers)})")  # fmt: skip
    if not guard.is_loopback(args.host) and not args.allowed_host:
        print("  (browsing it by another name or address? add it: --allowed-host NAME; other "
              "names get 421)")  # fmt: skip


def _dashboard_guard(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The Host allow-list and the token for `jobfence dashboard`, or a GuardError: a weak
    token; no token while bound off loopback or with --allow-actions."""
    from jobfence.worker.dashboard import guard

    token = guard.check_token(os.environ.get(guard.TOKEN_ENV))
    exposed = [why for why, yes in [
        (f"it binds {args.host}, off loopback", not guard.is_loopback(args.host)),
        ("--allow-actions lets it release locks", args.allow_actions),
    ] if yes]  # fmt: skip
    if exposed and token is None:
        raise guard.GuardError(
            f"{' and '.join(exposed)}, with no login: set {guard.TOKEN_ENV} to 32+ random "
            f"characters (make one with {guard.MAKE_TOKEN}) and log in with it, or bind "
            f"127.0.0.1 without --allow-actions"
        )
    port = args.port
    hosts = [f"{name}:{port}" for name in guard.LOOPBACK_HOSTS]
    if args.host not in ("0.0.0.0", "::", ""):
        hosts.insert(0, guard.url_host(args.host, port))
    hosts += args.allowed_host
    guard.HostList(hosts)  # a malformed --allowed-host is refused here, naming it
    return hosts, token
