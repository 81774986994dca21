"""`python -m jobfence <command>`: locks admin, start-up check, migrations, the dashboard; the
fleet, the demo, benchmarks and the fault report from a checkout.

This module assembles the parser and dispatches; each command group lives in its own module:
`cli_locks`, `cli_check`, `cli_migrate`, `cli_dashboard`, and `cli_common` for what they share
(`--app`, the settings a command reads, argument types)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from jobfence.config import UnsafeSettings
from jobfence.config.errors import EX_CONFIG
from jobfence.locks import LockError
from jobfence.locks.registry import MissingExtra
from jobfence.worker.cli_check import add_check_parser
from jobfence.worker.cli_check import cmd_check as cmd_check
from jobfence.worker.cli_common import AppNotFound as AppNotFound
from jobfence.worker.cli_common import add_app_option as add_app_option
from jobfence.worker.cli_common import app_module as app_module
from jobfence.worker.cli_common import describe_source as describe_source
from jobfence.worker.cli_common import load_app as load_app
from jobfence.worker.cli_common import missing_app_module as missing_app_module
from jobfence.worker.cli_common import positive_int as positive_int
from jobfence.worker.cli_common import positive_seconds as positive_seconds
from jobfence.worker.cli_common import project_settings as project_settings
from jobfence.worker.cli_dashboard import add_dashboard_parser
from jobfence.worker.cli_dashboard import cmd_dashboard as cmd_dashboard
from jobfence.worker.cli_locks import add_locks_parser
from jobfence.worker.cli_locks import cmd_locks as cmd_locks
from jobfence.worker.cli_migrate import add_migrate_parser
from jobfence.worker.cli_migrate import cmd_migrate as cmd_migrate
from jobfence.worker.cli_outbox import add_outbox_parser, cmd_outbox

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
    add_migrate_parser(sub)
    add_outbox_parser(sub)
    add_dashboard_parser(sub)

    sub.add_parser(
        "fleet",
        help="run N real celery workers and the beat(s) of your app or the demo shop; Ctrl-C "
        "stops them cleanly (from a checkout: demo/fleet.py)",
        add_help=False,
    )
    add_locks_parser(sub)
    add_check_parser(sub)
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


# --------------------------------------------------------------------------- from a checkout


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
        "outbox": cmd_outbox,
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
