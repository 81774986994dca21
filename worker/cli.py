"""`python -m jobfence <command>`: fleet, locks admin, start-up check, benchmarks and the demo."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jobfence.config import Settings, UnsafeSettings, load_settings
from jobfence.locks import LockBackend, LockError

PASSTHROUGH = ("bench", "demo")  # commands whose arguments belong to another program
BENCHES = {
    "locks": "jobfence.worker.bench.locks_bench",
    "celery": "jobfence.worker.bench.celery_bench",
}


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jobfence",
        description="jobfence operations: a local fleet, lock administration, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_migrate_parser(sub)

    fleet = sub.add_parser(
        "fleet",
        help="run N real celery workers and the beat(s); Ctrl-C stops them cleanly",
        description="Run real `celery worker` processes and beat(s) of worker.celery_app. "
        "With no broker or lock URL (options or JOBFENCE_* variables) it starts an embedded "
        "stack: a private redis-server and an SQLite ledger in a temporary directory.",
    )
    fleet.add_argument("--workers", type=_positive_int, default=2, metavar="N")
    fleet.add_argument(
        "--concurrency",
        type=_positive_int,
        default=2,
        metavar="C",
        help="pool processes per worker (default 2)",
    )
    beats = fleet.add_mutually_exclusive_group()
    beats.add_argument(
        "--beats",
        type=_positive_int,
        default=1,
        metavar="B",
        help="beat processes; more than one shows the leader election",
    )
    beats.add_argument("--no-beat", action="store_true", help="start no beat")
    fleet.add_argument("--broker", metavar="URL", help="Celery broker (JOBFENCE_BROKER_URL)")
    fleet.add_argument("--lock-backend", metavar="URL", help="lock server (JOBFENCE_LOCK_URL)")
    fleet.add_argument("--database", metavar="URL", help="ledger (JOBFENCE_DATABASE_URL)")
    fleet.add_argument("--pool", default="prefork", choices=["prefork", "solo", "threads"])
    fleet.add_argument("--loglevel", default="INFO")
    fleet.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="warm-shutdown deadline before SIGKILL (default 30)",
    )
    fleet.add_argument("--app", default="jobfence.worker.celery_app", help=argparse.SUPPRESS)

    locks = sub.add_parser("locks", help="list, inspect, release locks; find orphans")
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
    rel = lsub.add_parser("release", help="remove a lock whatever its owner (needs --force)")
    rel.add_argument("key")
    rel.add_argument(
        "--force", action="store_true", help="yes, remove it: its holder's fenced writes will fail"
    )
    orph = lsub.add_parser(
        "orphans",
        help="locks whose owner is provably dead",
        description="A lock is orphaned if its holder ran on this host and its pid is gone, "
        "or its heartbeat is older than --stale-factor x TTL.",
    )
    orph.add_argument("--match", default="*", metavar="GLOB")
    orph.add_argument(
        "--stale-factor",
        type=float,
        default=2.0,
        metavar="N",
        help="heartbeat older than N x JOBFENCE_DEFAULT_TTL (default 2)",
    )
    orph.add_argument("--release", action="store_true", help="force-release the orphans found")
    orph.add_argument("--json", action="store_true")

    sub.add_parser("check", help="run the start-up checks against the configured servers")
    sub.add_parser("bench", help="benchmarks: bench locks|celery [ARGS...]", add_help=False)
    sub.add_parser(
        "demo", help="the main job: a real fleet through a storm of duplicates", add_help=False
    )
    return parser


def _add_migrate_parser(sub: Any) -> None:
    migrate = sub.add_parser(
        "migrate",
        help="create jobfence's SQL tables (fences, job records) now",
        description="Create jobfence's tables (jobfence_fences, jobfence_jobs) where they are "
        "missing; safe to repeat. Workers create them on first use anyway: run this when a "
        "DBA or a deploy step owns the schema and the workers' role may not create tables.",
    )
    migrate.add_argument(
        "--database", metavar="URL", help="SQLAlchemy URL (default: JOBFENCE_DATABASE_URL)"
    )
    migrate.add_argument(
        "--sql",
        action="store_true",
        help="print the DDL for the URL's dialect instead of running it (connects to nothing)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# --------------------------------------------------------------------------- commands


def cmd_fleet(args: argparse.Namespace) -> int:
    from jobfence.worker.fleet import FleetOptions, run_fleet

    options = FleetOptions(
        workers=args.workers,
        concurrency=args.concurrency,
        beats=0 if args.no_beat else args.beats,
        broker=args.broker,
        lock_url=args.lock_backend,
        database=args.database,
        app=args.app,
        pool=args.pool,
        loglevel=args.loglevel,
        shutdown_timeout=args.shutdown_timeout,
    )
    return run_fleet(options)


def _settings(lock_url: str | None) -> Settings:
    return load_settings(lock_url=lock_url) if lock_url else load_settings()


def _emit(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def cmd_locks(args: argparse.Namespace) -> int:
    from jobfence.worker import admin

    settings = _settings(args.lock_url)
    backend = admin.open_admin_backend(settings)
    try:
        action: Callable[[argparse.Namespace, Settings, LockBackend], int] = {
            "list": _locks_list,
            "inspect": _locks_inspect,
            "release": _locks_release,
            "orphans": _locks_orphans,
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
        print(admin.describe(info, now) if info else f"{args.key}: not held")
        if record is not None:
            print(f"job record:     {record.state} (fence {record.fence}) result {record.result}")
    return 0 if info is not None else 1


def _locks_release(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    if not args.force:
        print(
            f"refusing to release {args.key!r} without --force: only its holder can release "
            "it safely. With --force the lock goes whatever its owner; the fence counter is "
            "kept, so a live holder's fenced writes fail from then on.",
            file=sys.stderr,
        )
        return 2
    held = backend.inspect(args.key)
    if not backend.force_release(args.key):
        print(f"{args.key}: not held")
        return 1
    holder = f" (was fence {held.fence}, host {held.host}, pid {held.pid})" if held else ""
    print(f"{args.key}: released{holder}")
    return 0


def _locks_orphans(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.worker import admin

    stale_after = args.stale_factor * settings.default_ttl
    orphans = admin.find_orphans(backend, stale_after=stale_after, match=args.match)
    released = []
    if args.release:
        released = [o.info.key for o in orphans if backend.force_release(o.info.key)]
    now = admin.server_time(backend)
    if args.json:
        _emit([
            {**admin.info_dict(o.info, now), "reason": o.reason,
             "released": o.info.key in released}
            for o in orphans
        ])  # fmt: skip
    elif orphans:
        print(admin.table([o.info for o in orphans], now, {o.info.key: o.reason for o in orphans}))
        for key in released:
            print(f"{key}: released")
    else:
        print("no orphaned locks")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from jobfence.tasks import runtime_for
    from jobfence.worker.app import create_app
    from jobfence.worker.checks import run_checks

    app = create_app(load_settings())
    app.loader.import_default_modules()  # the task modules, as a worker imports them
    runtime = runtime_for(app)
    try:
        findings = run_checks(app, runtime)
    finally:
        runtime.close()
    for f in findings:
        print(f"{'REFUSED' if f.refuse else 'warning'}: {f}")
    refused = any(f.refuse for f in findings)
    print("start-up checks: " + ("refused" if refused else "passed"))
    return 1 if refused else 0


def cmd_migrate(args: argparse.Namespace) -> int:
    import os

    import sqlalchemy as sa

    from jobfence.config.settings import ENV_PREFIX
    from jobfence.locks.sql import SchemaError, create_tables, ddl
    from jobfence.tasks.effects import TABLES, make_engine

    raw = args.database or os.environ.get(f"{ENV_PREFIX}DATABASE_URL")
    if not raw:
        print(
            f"jobfence migrate: no database: set {ENV_PREFIX}DATABASE_URL or pass --database "
            "URL (e.g. postgresql+psycopg://user@db.internal/app)",
            file=sys.stderr,
        )
        return 2
    try:
        url = sa.make_url(raw)
        if args.sql:
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


def _load_main(module: str, what: str, hint: str) -> Callable[[list[str]], int] | None:
    """`module.main`, imported only now; None (with a message) if the module is missing."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            print(f"{what} is not available: module {module} is missing ({hint})", file=sys.stderr)
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
        "benchmarks ship in the source tree: run from the repository root, with "
        "pip install -e '.[bench]'",
    )
    return 2 if main is None else int(main(argv[1:]) or 0)


def cmd_demo(argv: list[str]) -> int:
    main = _load_main("jobfence.worker.demo", "the demo", "it is not written yet")
    return 2 if main is None else int(main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "bench":
        return cmd_bench(args_list[1:])
    if args_list and args_list[0] == "demo":
        return cmd_demo(args_list[1:])
    args = build_parser().parse_args(args_list)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "fleet": cmd_fleet,
        "locks": cmd_locks,
        "check": cmd_check,
        "migrate": cmd_migrate,
    }
    try:
        return commands[args.command](args)
    except UnsafeSettings as exc:
        print(f"jobfence: unsafe settings: {exc}", file=sys.stderr)
        return 2
    except LockError as exc:
        print(f"jobfence: {exc}", file=sys.stderr)
        return 2
