"""`python -m jobfence fleet`: N real `celery worker` processes and beats of your app or the demo
shop, stopped on Ctrl-C. From a checkout: it lives beside the demo, not in the wheel."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

from demo.embedded import EmbeddedStack, EmbeddedStackError
from devstack import procs
from jobfence.config import Settings, UnsafeSettings, load_settings
from jobfence.config.settings import ENV_PREFIX
from jobfence.worker.cli import missing_app_module, positive_int, positive_seconds

DEMO_APP = "demo.app"  # the demo shop's app, the fleet's default
#: The checkout root, on the children's PYTHONPATH for the demo's app (whatever the directory).
CHECKOUT = Path(__file__).resolve().parents[1]
READY_LINE = re.compile(r"@\S+ ready\.\s*$")
BEAT_READY_LINE = re.compile(r"beat: Starting\.\.\.")


class FleetError(RuntimeError):
    """A fleet process exited during start-up or did not get ready in time."""


METRICS_PORT = f"{ENV_PREFIX}METRICS_PORT"


def metrics_env(env: Mapping[str, str], index: int) -> Mapping[str, str]:
    """Worker `index`'s (1-based) variables: one host, so each its own /metrics port.

    JOBFENCE_METRICS_PORT=P gives worker 1 port P, worker 2 P+1, ...; `env` itself when the
    variable is unset (or no number: the worker's settings then refuse it, naming it).
    """
    raw = env.get(METRICS_PORT, "").strip()
    if not raw.isdigit():
        return env
    return {**env, METRICS_PORT: str(int(raw) + index - 1)}


@dataclass(frozen=True)
class FleetOptions:
    workers: int = 2
    concurrency: int = 2
    beats: int = 1
    broker: str | None = None
    lock_url: str | None = None
    database: str | None = None
    app: str = DEMO_APP  # `celery -A` spec of the app the processes run
    pool: str = "prefork"
    loglevel: str = "INFO"
    shutdown_timeout: float = 30.0
    startup_timeout: float = 60.0
    extra_env: Mapping[str, str] = field(default_factory=dict)  # more variables for children


@dataclass
class Member:
    """One started process of the fleet and the thread that copies its output."""

    name: str
    proc: subprocess.Popen[bytes]
    ready: threading.Event = field(default_factory=threading.Event)
    pump: threading.Thread | None = None


class Fleet:
    """Starts the processes, forwards their output with a name prefix, stops them all.

    Every process leads its own session, so the terminal's Ctrl-C reaches only this
    program, which turns it into a warm shutdown (SIGTERM to each worker and beat), then
    SIGKILLs whatever is left of each process group after `shutdown_timeout`. A second
    Ctrl-C kills at once. Only processes started here are ever signalled.
    """

    def __init__(self, options: FleetOptions, out: IO[str] | None = None) -> None:
        self.options = options
        self.out = out or sys.stdout
        self.members: list[Member] = []
        self.stack: EmbeddedStack | None = None
        self._signals = 0
        self._wake = threading.Event()
        self._print_lock = threading.Lock()

    # -- output ---------------------------------------------------------------------
    def say(self, text: str) -> None:
        with self._print_lock:
            self.out.write(f"fleet: {text}\n")
            self.out.flush()

    def _pump(self, member: Member, stream: IO[bytes]) -> None:
        beat = member.name.startswith("beat")
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if (BEAT_READY_LINE if beat else READY_LINE).search(line):
                member.ready.set()
                self._wake.set()
            with self._print_lock:
                self.out.write(f"[{member.name}] {line}\n")
                self.out.flush()
        stream.close()

    # -- set-up ---------------------------------------------------------------------
    def environment(self) -> dict[str, str]:
        """Variables for the children: `extra_env` and the options' URLs; for the demo shop
        with no lock or broker URL there or in the environment, an embedded stack's (started
        here). A user's own app keeps its broker and reads JOBFENCE_* as it would anyway."""
        o = self.options
        env = dict(o.extra_env)
        if o.lock_url:
            env[f"{ENV_PREFIX}LOCK_URL"] = o.lock_url
        if o.broker:
            env[f"{ENV_PREFIX}BROKER_URL"] = o.broker
        names = {f"{ENV_PREFIX}{name.upper()}": name for name in Settings.model_fields}
        settings = load_settings(**{names[k]: v for k, v in env.items() if k in names})
        configured = {"lock_url", "broker_url"} & settings.model_fields_set
        if not configured and o.app == DEMO_APP:
            self.stack = EmbeddedStack().start()
            env.update(self.stack.env())
            self.say(
                f"embedded redis-server pid {self.stack.pid} at {self.stack.lock_url} "
                f"(data in {self.stack.workdir})"
            )
            self.say(
                f"embedded broker redis-server pid {self.stack.broker_server.pid} at "
                f"{self.stack.broker_url}"
            )
            self.say(f"embedded ledger {self.stack.database_url}")
        if o.database:
            env[f"{ENV_PREFIX}DATABASE_URL"] = o.database
        return env

    def _start(self, name: str, args: list[str], env: Mapping[str, str]) -> None:
        proc = procs.spawn(args, env=env, stdout=subprocess.PIPE)
        member = Member(name, proc)
        assert proc.stdout is not None
        member.pump = threading.Thread(
            target=self._pump, args=(member, proc.stdout), name=f"pump-{name}", daemon=True
        )
        member.pump.start()
        self.members.append(member)
        self.say(f"{name} pid {proc.pid}")

    def start(self) -> None:
        o = self.options
        env = {**os.environ, **self.environment(), "PYTHONUNBUFFERED": "1"}
        if o.app == DEMO_APP:  # the demo is no installed package: its checkout, for celery -A
            paths = [str(CHECKOUT), env.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        celery = [sys.executable, "-m", "celery", "-A", o.app]
        for i in range(1, o.workers + 1):
            worker_env = metrics_env(env, i)
            if worker_env is not env:
                self.say(f"worker-{i} /metrics on port {worker_env[METRICS_PORT]}")
            self._start(
                f"worker-{i}",
                [*celery, "worker", "--loglevel", o.loglevel, "--concurrency",
                 str(o.concurrency), "--pool", o.pool, "--hostname", f"fleet-{i}@%h"],
                worker_env,
            )  # fmt: skip
        for i in range(1, o.beats + 1):  # LeaderScheduler keeps no schedule file
            self._start(f"beat-{i}", [*celery, "beat", "--loglevel", o.loglevel], env)

    # -- running --------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals += 1
        self._wake.set()

    def wait_ready(self, timeout: float) -> None:
        """Block until every process reported ready; FleetError if one exits or time runs out."""
        deadline = time.monotonic() + timeout
        while not all(m.ready.is_set() for m in self.members):
            dead = self._failed()
            if dead is not None:
                raise FleetError(f"{dead.name} (pid {dead.proc.pid}) exited during start-up")
            if time.monotonic() >= deadline:
                waiting = ", ".join(m.name for m in self.members if not m.ready.is_set())
                raise FleetError(f"{waiting} not ready within {timeout:g}s")
            self._wake.wait(0.1)
            self._wake.clear()

    def _failed(self) -> Member | None:
        for m in self.members:
            if procs.exited(m.proc):
                return m
        return None

    def watch(self) -> int:
        """Wait for Ctrl-C (0) or for a process that exits on its own (1)."""
        announced = False
        started = time.monotonic()
        while not self._signals:
            dead = self._failed()
            if dead is not None:
                self.say(f"{dead.name} (pid {dead.proc.pid}) exited on its own; stopping")
                return 1
            if not announced and all(m.ready.is_set() for m in self.members):
                announced = True
                self.say(
                    f"ready: {self.options.workers} workers, {self.options.beats} beats "
                    "(Ctrl-C to stop)"
                )
            elif not announced and time.monotonic() - started > self.options.startup_timeout:
                announced = True
                waiting = [m.name for m in self.members if not m.ready.is_set()]
                self.say(f"still waiting for {', '.join(waiting)} to report ready")
            self._wake.wait(0.2)
            self._wake.clear()
        return 0

    def stop(self) -> None:
        """Warm shutdown, SIGKILL after the deadline (or at a second Ctrl-C), reap all."""
        if self.members:
            self.say(
                f"stopping {len(self.members)} processes (warm shutdown, up to "
                f"{self.options.shutdown_timeout:g}s; Ctrl-C again to kill now)"
            )
        seen = self._signals
        for m in self.members:
            procs.signal_leader(m.proc, signal.SIGCONT)
            procs.signal_leader(m.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.options.shutdown_timeout
        while not all(procs.exited(m.proc) for m in self.members):
            if self._signals > seen or time.monotonic() >= deadline:
                self.say("killing what is left")
                break
            self._wake.wait(0.1)
            self._wake.clear()
        for m in self.members:
            code = procs.finish(m.proc)
            self.say(f"{m.name} (pid {m.proc.pid}) exited with {code}")
        for m in self.members:
            if m.pump is not None:
                m.pump.join(timeout=5)
        if self.stack is not None:
            self.stack.stop()
            self.say("embedded redis-server stopped")
            self.stack = None

    def run(self) -> int:
        handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            try:
                self.start()
            except (UnsafeSettings, EmbeddedStackError, OSError) as exc:
                self.say(f"cannot start: {exc}")
                return 2
            code = self.watch()
        finally:
            try:
                self.stop()
            finally:
                for sig, old in handlers.items():
                    signal.signal(sig, old)
        self.say("stopped")
        return code


def run_fleet(options: FleetOptions, out: IO[str] | None = None) -> int:
    return Fleet(options, out).run()


# -- the command ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jobfence fleet",
        description="Run real `celery worker` processes and beat(s) of your Celery app "
        "(--app), or of the demo shop. For the demo shop with no broker or lock URL "
        "(options or JOBFENCE_* variables) it starts an embedded stack: a private "
        "redis-server and an SQLite ledger in a temporary directory.",
    )
    parser.add_argument(
        "--app",
        "-A",
        default=DEMO_APP,
        metavar="MODULE[:ATTR]",
        help="your Celery app, as `celery -A` takes it (e.g. proj.tasks:app, or a module "
        "holding `app`), imported from the current directory (default: the demo shop, "
        f"{DEMO_APP})",
    )
    parser.add_argument("--workers", type=positive_int, default=2, metavar="N")
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=2,
        metavar="C",
        help="pool processes per worker (default 2)",
    )
    beats = parser.add_mutually_exclusive_group()
    beats.add_argument(
        "--beats",
        type=positive_int,
        default=1,
        metavar="B",
        help="beat processes; more than one shows the leader election",
    )
    beats.add_argument("--no-beat", action="store_true", help="start no beat")
    parser.add_argument(
        "--broker",
        metavar="URL",
        help="the demo shop's Celery broker (JOBFENCE_BROKER_URL); your own app's broker "
        "is set in your app",
    )
    parser.add_argument("--lock-backend", metavar="URL", help="lock server (JOBFENCE_LOCK_URL)")
    parser.add_argument("--database", metavar="URL", help="ledger (JOBFENCE_DATABASE_URL)")
    parser.add_argument("--pool", default="prefork", choices=["prefork", "solo", "threads"])
    parser.add_argument("--loglevel", default="INFO")
    parser.add_argument(
        "--shutdown-timeout",
        type=positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="warm-shutdown deadline before SIGKILL (default 30)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.app != DEMO_APP:
        if args.broker:
            print(
                "jobfence: --broker sets the demo shop's broker; your app "
                f"{args.app} publishes to the broker it sets itself",
                file=sys.stderr,
            )
            return 2
        missing = missing_app_module(args.app)
        if missing:
            print(f"jobfence: {missing}", file=sys.stderr)
            return 2
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
