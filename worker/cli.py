"""`python -m jobfence <command>`: locks admin, start-up check, migrations, the dashboard; the
fleet, the demo, benchmarks and the fault report from a checkout."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from jobfence.config import Settings, UnsafeSettings, load_settings
from jobfence.config.errors import EX_CONFIG, InsecureSettings
from jobfence.locks import LockBackend, LockError
from jobfence.locks.registry import MissingExtra

PASSTHROUGH = ("bench", "demo", "faults", "fleet")  # their arguments belong to another program
BENCHES = {
    "locks": "devstack.bench.locks_bench",
    "celery": "devstack.bench.celery_bench",
    "gate": "devstack.bench.gate_bench",
    "leader": "devstack.bench.leader_bench",
    "memory": "devstack.bench.memory_bench",
    "keeper": "devstack.bench.keeper_bench",
    "server": "devstack.bench.server_bench",
    "publish": "devstack.bench.publish_bench",
}


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jobfence",
        description="jobfence operations: lock administration, start-up checks, migrations, "
        "the dashboard; from a checkout, a local fleet, the demo, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_migrate_parser(sub)
    _add_dashboard_parser(sub)

    sub.add_parser(
        "fleet",
        help="run N real celery workers and the beat(s) of your app or the demo shop; Ctrl-C "
        "stops them cleanly (from a checkout: demo/fleet.py)",
        add_help=False,
    )

    locks = sub.add_parser("locks", help="list, inspect, release locks; find orphans")
    add_app_option(locks)
    locks.add_argument(
        "--lock-url",
        "--lock-backend",
        dest="lock_url",
        metavar="URL",
        help="lock server (default: JOBFENCE_LOCK_URL)",
    )
    lsub = locks.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = lsub.add_parser("list", help="held locks")
    ls.add_argument("--match", default="*", metavar="GLOB", help="lock keys matching GLOB")
    ls.add_argument("--json", action="store_true")
    ins = lsub.add_parser("inspect", help="one lock: fence, holder, heartbeat, job record")
    ins.add_argument("key")
    ins.add_argument("--json", action="store_true")
    rel = lsub.add_parser(
        "release",
        help="remove a lock whatever its owner (needs --force)",
        description="Remove a lock whatever its owner, then advance its fence (a grant taken "
        "and released at once), so every later grant is above the removed holder's. The "
        "removed holder's fenced writes fail once a newer fence was accepted for the same "
        "resource; --fence-resource raises a Redis guard's floor now, so they fail at once.",
    )
    rel.add_argument("key")
    rel.add_argument("--force", action="store_true", help="yes, remove it whatever its owner")
    rel.add_argument(
        "--fence-resource",
        action="append",
        default=[],
        metavar="RESOURCE",
        help="a RedisFenceGuard resource (on the lock server) this key's holders write: raise "
        "its floor to the new fence, so the removed holder's writes fail now (repeatable)",
    )
    _add_why_parser(lsub)
    orph = lsub.add_parser(
        "orphans",
        help="locks whose owner is provably dead, and suspects",
        description="A lock is orphaned only if its owner is provably dead: it ran on this "
        "host, in this pid namespace, and its pid is gone or now belongs to a later process "
        "(a stopped process is alive). A heartbeat late for the lock's own TTL, or a holder "
        "elsewhere, is reported as a suspect and never released.",
    )
    orph.add_argument("--match", default="*", metavar="GLOB")
    orph.add_argument(
        "--release", action="store_true", help="release the dead ones (owner-checked)"
    )
    orph.add_argument("--json", action="store_true")

    for action in lsub.choices.values():
        add_app_option(action, inner=True)

    check = sub.add_parser(
        "check",
        help="run the start-up checks against the configured servers",
        description="Run the checks a worker of the app runs at start (serialisers, eviction "
        "policy of the lock server and a Redis broker, TTLs against the visibility timeout) "
        "and list every finding. Exit status 78 (EX_CONFIG, as a refused worker) if any "
        "refuses or the settings cannot be read; 0 if they pass, warnings included.",
    )
    add_app_option(check, default="create_app() from JOBFENCE_*: settings, no tasks")
    sub.add_parser(
        "bench",
        help="benchmarks: bench locks|celery|gate|leader|memory|keeper|server [ARGS...]",
        add_help=False,
    )
    sub.add_parser(
        "demo", help="the main job: a real fleet through a storm of duplicates", add_help=False
    )
    sub.add_parser(
        "faults",
        help="the fault report: each injected fault against a naive task and jobfence",
        add_help=False,
    )
    return parser


def _add_dashboard_parser(sub: Any) -> None:
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
    app = None
    if args.app:
        from jobfence.tasks import runtime_for

        try:
            app = load_app(args.app)
        except AppNotFound as exc:
            print(f"jobfence: {exc}", file=sys.stderr)
            return 2
        settings = runtime_for(app).settings
    else:
        settings = project_settings(args, args.lock_url)
    _say_source(args, settings, args.lock_url)
    backend = admin.open_admin_backend(settings)
    dashboard = Dashboard(backend, actions=args.allow_actions, app=app,
                          metrics_url=args.metrics_url, allowed_hosts=hosts,
                          token=token, hide_names=args.hide_lock_names)  # fmt: skip
    mode = "actions enabled" if args.allow_actions else "read-only"
    login = "token login" if token else "no login"
    print(f"jobfence dashboard on http://{guard.url_host(args.host, args.port)}/ ({backend.name}, "
          f"{mode}, {login}; answers Host {', '.join(dashboard.hosts.entries)})")  # fmt: skip
    if not guard.is_loopback(args.host) and not args.allowed_host:
        print("  (browsing it by another name or address? add it: --allowed-host NAME; other "
              "names get 421)")  # fmt: skip
    try:
        uvicorn.run(build_app(dashboard), host=args.host, port=args.port, log_level="warning")
    finally:
        backend.close()
    return 0


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


def _add_why_parser(lsub: Any) -> None:
    why = lsub.add_parser(
        "why",
        help="why did this job (not) run: its decisions, from the decision log",
        description="The decisions about a task id (or a job key, `<task name>:<hash>` as "
        "`locks list` shows it), in order, in plain words: granted, skipped as a duplicate of "
        "which task, superseded by which publish, a stale write refused, redelivered, given "
        "up. Kept on Redis (JOBFENCE_DECISION_LOG_SIZE per key, for JOBFENCE_DECISION_LOG_TTL); "
        "other backends keep the worker's log lines only (logger jobfence.decisions).",
    )
    why.add_argument("subject", metavar="KEY_OR_TASK_ID")
    why.add_argument("--limit", type=positive_int, default=50, metavar="N",
                     help="the last N decisions (default 50)")  # fmt: skip
    why.add_argument("--json", action="store_true")


def _add_migrate_parser(sub: Any) -> None:
    migrate = sub.add_parser(
        "migrate",
        help="create jobfence's SQL tables (fences, job records, SQL locks) now",
        description="Create jobfence's tables (jobfence_fences, jobfence_jobs) where they are "
        "missing, and the lock backend's tables when the lock URL is PostgreSQL or "
        "MySQL/MariaDB; safe to repeat. Workers create them on first use anyway: run this "
        "when a DBA or a deploy step owns the schema and the workers' role may not create "
        "tables.",
    )
    add_app_option(migrate)
    migrate.add_argument(
        "--database", metavar="URL", help="SQLAlchemy URL (default: JOBFENCE_DATABASE_URL)"
    )
    migrate.add_argument(
        "--lock-url",
        metavar="URL",
        help="lock server (default: JOBFENCE_LOCK_URL); its tables are made for "
        "postgresql:// and mysql:// / mariadb:// URLs, nothing for Redis",
    )
    migrate.add_argument(
        "--sql",
        action="store_true",
        help="print the DDL for the URL's dialect instead of running it (connects to nothing)",
    )


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


# --------------------------------------------------------------------------- commands


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


def _say_source(args: argparse.Namespace, settings: Settings, lock_url: str | None) -> None:
    # On stderr under --json, so the JSON on stdout stays parseable.
    line = describe_source(args, settings, lock_url)
    print(line, file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)


def _emit(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def cmd_locks(args: argparse.Namespace) -> int:
    from jobfence.worker import admin

    try:
        settings = project_settings(args, args.lock_url)
    except AppNotFound as exc:
        print(f"jobfence: {exc}", file=sys.stderr)
        return 2
    _say_source(args, settings, args.lock_url)
    backend = admin.open_admin_backend(settings)
    try:
        action: Callable[[argparse.Namespace, Settings, LockBackend], int] = {
            "list": _locks_list,
            "inspect": _locks_inspect,
            "release": _locks_release,
            "orphans": _locks_orphans,
            "why": _locks_why,
        }[args.action]
        return action(args, settings, backend)
    finally:
        backend.close()


def _locks_list(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.worker import admin

    infos = sorted(backend.scan(args.match), key=lambda i: i.key)
    now = admin.server_time(backend)
    if args.json:
        _emit([admin.info_dict(i, now) for i in infos])
    elif infos:
        print(admin.table(infos, now))
    else:
        print(f"no locks held matching {args.match!r}")
    return 0


def _locks_inspect(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.worker import admin

    info = backend.inspect(args.key)
    record = backend.job_record(args.key)
    now = admin.server_time(backend)
    if args.json:
        _emit({
            "lock": admin.info_dict(info, now) if info else None,
            "record": None if record is None else {
                "state": record.state, "fence": record.fence,
                "finished_at": record.finished_at, "result": record.result,
            },
        })  # fmt: skip
    else:
        print(admin.describe(info, now) if info else admin.printable(f"{args.key}: not held"))
        if record is not None:
            print(admin.printable(
                f"job record:     {record.state} (fence {record.fence}) result {record.result}"
            ))
    return 0 if info is not None else 1


def _locks_release(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.worker import admin

    if not args.force:
        print(
            f"refusing to release {args.key!r} without --force: only its holder can release "
            "it safely. With --force the lock goes whatever its owner and its fence is "
            "advanced; the holder's fenced writes fail once a newer fence was accepted for "
            "the same resource, or at once for each --fence-resource given.",
            file=sys.stderr,
        )
        return 2
    done = admin.force_release(
        backend, args.key, resources=args.fence_resource, guard_prefix=settings.key_prefix
    )
    held = done.held
    key = admin.printable(args.key)
    if held is None:
        print(f"{key}: not held")
    else:
        host = admin.printable(held.host)
        print(f"{key}: released (was fence {held.fence}, host {host}, pid {held.pid})")
    if done.floor is not None:
        print(f"{key}: fence advanced to {done.floor}; every later grant is above it")
    for resource, floor in done.advanced.items():
        print(
            f"{resource}: guard floor now {floor}: writes with an earlier grant's fence "
            f"(below {done.floor}) fail with StaleFence from now on"
        )
    if held is None:
        return 1
    if not done.advanced:
        print(
            f"the removed holder (fence {held.fence}) may still write until a newer fence is "
            "accepted by the resource it writes; to refuse it now, raise the resource's floor "
            f"to {done.floor}: --fence-resource RESOURCE (Redis guard), or "
            "SqlFenceGuard().check_and_advance(conn, RESOURCE, fence) in a transaction (SQL)"
        )
    return 0


def _locks_why(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.locks.decisions import DecisionBounds
    from jobfence.worker import admin, why

    size = settings.decision_log_size
    store = backend.decision_log(DecisionBounds(
        per_key=max(size, 1), total=settings.decision_log_total, ttl=settings.decision_log_ttl,
    )) if size else None  # fmt: skip
    if store is None:
        print(f"the {backend.name} lock backend keeps no decision log"
              + (" (JOBFENCE_DECISION_LOG_SIZE=0)" if not size else "")
              + "; the workers log every decision (logger jobfence.decisions)",
              file=sys.stderr)  # fmt: skip
        return 2
    lines, data = why.render(store, args.subject, args.limit)
    if args.json:
        _emit(data)
    elif lines:
        print("\n".join(lines))
    else:
        print(admin.printable(
            f"no decisions recorded for {args.subject!r} (kept {size} per key, "
            f"{settings.decision_log_ttl:g}s after the key's last; memory:// keeps them in the "
            "worker's process only)"
        ))
    return 0 if data else 1


def _locks_orphans(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.worker import admin

    orphans = admin.find_orphans(backend, match=args.match)
    released = []
    if args.release:
        released = [
            o.info.key
            for o in orphans
            if o.dead and admin.release_grant(backend, o.info.key, o.info.fence)
        ]
    now = admin.server_time(backend)
    if args.json:
        _emit([
            {**admin.info_dict(o.info, now), "reason": o.reason, "dead": o.dead,
             "ttl": None if o.ttl is None else round(o.ttl, 3),
             "released": o.info.key in released}
            for o in orphans
        ])  # fmt: skip
    elif orphans:
        reasons = {o.info.key: ("DEAD: " if o.dead else "suspect: ") + o.reason for o in orphans}
        print(admin.table([o.info for o in orphans], now, reasons))
        for key in released:
            print(f"{admin.printable(key)}: released")
        if any(not o.dead for o in orphans):
            print("suspects are reported only: a late heartbeat or a holder elsewhere is no proof")
    else:
        print("no orphaned or suspect locks")
    return 0


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


def cmd_check(args: argparse.Namespace) -> int:
    from jobfence.tasks import runtime_for
    from jobfence.worker.checks import lock_security, posture_lines, run_checks

    if args.app:
        from jobfence.worker.setup import is_set_up

        try:
            app = load_app(args.app)
        except AppNotFound as exc:
            print(f"jobfence: {exc}", file=sys.stderr)
            return 2
        print(f"app: {args.app}")
        if not is_set_up(app):
            print(
                f"note: {args.app} is not set up with jobfence.setup(app): its workers do not "
                "run these checks at start, and its Celery settings are its own"
            )
    else:
        from jobfence.worker.app import create_app

        print("app: none given: create_app() from JOBFENCE_* (settings only, no tasks)")
        settings = load_settings()
        try:
            app = create_app(settings)
        except InsecureSettings as exc:
            return _refused_before_connecting(None, settings, exc)
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
        health = runtime.backend.health()
        state = "ok" if health.ok else "NOT ANSWERING"
        print(f"health of the {runtime.backend.name} lock backend: {state} in "
              f"{health.latency * 1000:.1f} ms ({health.detail})")  # fmt: skip
        print("security posture:")
        for line in posture_lines(app.conf, runtime.settings, lock_security(runtime)):
            print(f"  {line}")
        findings = run_checks(app, runtime)
    finally:
        runtime.close()
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


def cmd_migrate(args: argparse.Namespace) -> int:
    import os

    from jobfence.config.settings import ENV_PREFIX

    raw = args.database or os.environ.get(f"{ENV_PREFIX}DATABASE_URL")
    lock_url = args.lock_url or os.environ.get(f"{ENV_PREFIX}LOCK_URL")
    if args.app:  # the project's own settings, as its workers read them
        try:
            settings = project_settings(args, args.lock_url)
        except AppNotFound as exc:
            print(f"jobfence migrate: {exc}", file=sys.stderr)
            return 2
        raw, lock_url = args.database or settings.database_url, settings.lock_url
        _say_source(args, settings, args.lock_url)
    sql_locks = lock_url is not None and _lock_scheme(lock_url) is not None
    if not raw and not sql_locks:
        print(
            f"jobfence migrate: no database: set {ENV_PREFIX}DATABASE_URL or pass --database "
            "URL (e.g. postgresql+psycopg://user@db.internal/app), or a PostgreSQL or "
            f"MySQL lock URL ({ENV_PREFIX}LOCK_URL or --lock-url)",
            file=sys.stderr,
        )
        return 2
    if raw:
        status = _migrate_effects(raw, sql=args.sql)
        if status:
            return status
    if sql_locks:
        assert lock_url is not None
        return _migrate_locks(lock_url, sql=args.sql)
    return 0


def _lock_scheme(url: str) -> str | None:
    """'postgres' or 'mysql' for a SQL lock URL, else None (Redis, memory: no tables)."""
    from jobfence.locks import registry

    try:
        name = registry.entry_for(url).name
    except ValueError:
        return None
    return name if name in ("postgres", "mysql") else None


def _migrate_effects(raw: str, *, sql: bool) -> int:
    """The SQL effects' tables (jobfence_fences, jobfence_jobs) on `raw`."""
    import sqlalchemy as sa

    from jobfence.locks.sql import SchemaError, create_tables, ddl
    from jobfence.tasks.effects import TABLES, make_engine

    try:
        url = sa.make_url(raw)
        if sql:
            for statement in ddl(url.get_dialect()(), TABLES):
                print(f"{statement};\n")
            return 0
        engine = make_engine(raw)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ValueError) as exc:
        print(f"jobfence migrate: bad database URL ({exc})", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        print(
            f"jobfence migrate: the driver {exc.name} is missing: "
            "pip install 'jobfence[postgres]' (or [mysql])",
            file=sys.stderr,
        )
        return 2
    where = url.render_as_string(hide_password=True)
    try:
        created = create_tables(engine, TABLES)
    except SchemaError as exc:
        print(f"jobfence migrate: {exc}", file=sys.stderr)
        return 1
    except sa.exc.DBAPIError as exc:
        print(f"jobfence migrate: {where}: {type(exc.orig).__name__}: {exc.orig}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    for table in TABLES:
        print(f"{table.name}: {'created' if table.name in created else 'already there'}")
    print(f"jobfence tables ready on {where}")
    return 0


def _migrate_locks(lock_url: str, *, sql: bool) -> int:
    """The lock backend's tables on a PostgreSQL or MySQL/MariaDB lock URL."""
    import sqlalchemy as sa

    from jobfence.config.settings import ENV_PREFIX
    from jobfence.locks import LockError, open_backend

    kind = _lock_scheme(lock_url)
    prefix = os.environ.get(f"{ENV_PREFIX}KEY_PREFIX") or "jobfence"
    try:
        backend: Any = open_backend(lock_url, prefix=prefix)
    except (LockError, ValueError, ImportError) as exc:
        print(f"jobfence migrate: bad lock URL ({exc})", file=sys.stderr)
        return 2
    try:
        if sql:
            for statement in backend.ddl():
                print(f"{statement};\n")
            return 0
        # What exists, asked through SQLAlchemy (the backends talk to their driver directly).
        rest = lock_url.split("://", 1)[1]
        sa_url = ("postgresql+psycopg://" if kind == "postgres" else "mysql+pymysql://") + rest
        if kind == "postgres":
            from jobfence.locks.backends.postgres import FENCE_SEQUENCE, TABLE

            objects = [("table", TABLE), ("sequence", FENCE_SEQUENCE)]
        else:
            tables = [*backend.tables.values(), backend.rate_table]  # rates: made with them
            objects = [("table", name.strip("`")) for name in tables]
        engine = sa.create_engine(sa_url, poolclass=sa.pool.NullPool)
        where = engine.url.render_as_string(hide_password=True)
        try:

            def present() -> set[str]:
                inspector = sa.inspect(engine)
                return {
                    name
                    for what, name in objects
                    if (inspector.has_sequence(name) if what == "sequence"
                        else inspector.has_table(name))
                }  # fmt: skip

            before = present()
            backend.create_tables()
            after = present()
        except (sa.exc.DBAPIError, LockError) as exc:
            print(f"jobfence migrate: lock tables on {where}: {exc}", file=sys.stderr)
            return 1
        finally:
            engine.dispose()
    finally:
        backend.close()
    for what, name in objects:
        state = "already there" if name in before else "created" if name in after else "missing"
        print(f"{name}: {state}" + (" (sequence)" if what == "sequence" else ""))
    if any(name not in after for _, name in objects):
        print(f"jobfence migrate: lock tables missing on {where} after creating them",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"jobfence lock tables ready on {where}")
    return 0


def _load_main(module: str, what: str, hint: str) -> Callable[[list[str]], int] | None:
    """`module.main`, imported only now; None (with a message) if the module is missing."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # The module, or a repository folder it builds on (the demo on devstack/'s launchers).
        if exc.name is not None and (
            module.startswith(exc.name) or exc.name.split(".")[0] in ("demo", "devstack")
        ):
            print(f"{what} is not available: module {exc.name} is missing ({hint})",
                  file=sys.stderr)  # fmt: skip
            return None
        print(f"{what} needs the module {exc.name}: pip install -e '.[bench]'", file=sys.stderr)
        return None
    main: Callable[[list[str]], int] = mod.main
    return main


def cmd_bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m jobfence bench {{{'|'.join(BENCHES)}}} [ARGS...]", file=sys.stderr)
        return 2
    main = _load_main(
        BENCHES[argv[0]],
        f"bench {argv[0]}",
        "the benchmarks live in devstack/ of the source tree, not in the wheel: run from "
        "a checkout's root, with pip install -e '.[bench]'",
    )
    return 2 if main is None else int(main(argv[1:]) or 0)


#: Where the demo's commands say they are, from a wheel.
DEMO_HINT = (
    "it lives in demo/ of the repository, not in the wheel: run `python -m jobfence {command}` "
    "from the root of a checkout of jobfence"
)


def cmd_demo(argv: list[str]) -> int:
    hint = DEMO_HINT.format(command="demo") + " (or `make demo` there, which sets it up)"
    main = _load_main("demo.storm", "the demo", hint)
    return 2 if main is None else int(main(argv) or 0)


def cmd_fleet(argv: list[str]) -> int:
    hint = DEMO_HINT.format(command="fleet") + (
        "; for your own app alone, `celery -A proj worker` and `celery -A proj beat` "
        "run the same processes"
    )
    main = _load_main("demo.fleet", "jobfence fleet", hint)
    return 2 if main is None else int(main(argv) or 0)


def cmd_faults(argv: list[str]) -> int:
    main = _load_main(
        "devstack.faults_report",
        "the fault report",
        "it lives in devstack/ of the source tree, not in the wheel, and runs the "
        "scenarios in tests/faults from a checkout's root",
    )
    return 2 if main is None else int(main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in PASSTHROUGH:
        passthrough: dict[str, Callable[[list[str]], int]] = {
            "bench": cmd_bench, "demo": cmd_demo, "faults": cmd_faults, "fleet": cmd_fleet,
        }  # fmt: skip
        return passthrough[args_list[0]](args_list[1:])
    args = build_parser().parse_args(args_list)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "locks": cmd_locks,
        "check": cmd_check,
        "migrate": cmd_migrate,
        "dashboard": cmd_dashboard,
    }
    try:
        return commands[args.command](args)
    except UnsafeSettings as exc:
        print(f"jobfence: unsafe settings: {exc}", file=sys.stderr)
        return EX_CONFIG if args.command == "check" else 2  # check: what a worker's start gets
    except (LockError, MissingExtra) as exc:
        print(f"jobfence: {exc}", file=sys.stderr)
        return 2
