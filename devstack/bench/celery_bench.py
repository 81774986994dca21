"""Celery benchmark: plain task, @singleton_task, celery-once and celery-singleton on one fleet."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import celery
import redis
from celery.result import EagerResult
from celery.utils import uuid

from devstack.bench import charts
from devstack.bench import report as report_io
from devstack.bench.locks_bench import BenchError, Server, server_cpu, start_private_redis

APP_MODULE = "devstack.bench.celery_bench_app"
BODY_ENV = "JOBFENCE_BENCH_BODY_MS"  # the app module's body wait, in milliseconds
PLAIN = "plain Celery task"
JOBFENCE = "jobfence @singleton_task"
ONCE = "celery-once QueueOnce"
SINGLETON = "celery-singleton Singleton"
CONTENDERS = {PLAIN: "plain", JOBFENCE: "jobfence", ONCE: "once", SINGLETON: "singleton"}
#: `--round-trip-control`: plain Celery whose body first makes two bare round trips (PING), as
#: many as a jobfence job makes in its pool process: the fleet's price of the round trips alone.
TRIPS = "plain + 2 round trips (control)"
#: @singleton_task's floor against plain Celery (issue 23), trivial bodies and bodies that wait
#: 5 ms, where the load generator and the servers have cores of their own; on a box whose
#: cores the fleet saturates, every contender's rate is the box's CPU per job instead.
TRIVIAL_TARGET = 0.95
BODY_TARGET = 0.99
#: The lock server's CPU per jobfence job at most this share of the broker's (issue 33): the
#: lock server is never the fleet's bottleneck while the broker is not.
LOCK_SHARE_TARGET = 0.5
WARMUP_JOBS = 200  # per contender, untimed: forks, connections and scripts are ready after
POLL = 0.005  # seconds between counter polls
REPO_ROOT = Path(__file__).resolve().parents[2]  # devstack/bench/ -> the checkout


@dataclass
class Contender:
    name: str
    task: Any  # the Celery task object
    seconds: list[float] = field(default_factory=list)  # publish start -> last job executed
    publish_seconds: list[float] = field(default_factory=list)
    storm_queued: int = 0  # storm messages that reached the broker
    storm_executions: int = 0  # storm bodies run
    #: Server CPU seconds (INFO cpu, main thread) over the timed rounds: the broker's (with
    #: the results database) and the lock server's (locks alone, with --one-server the same).
    broker_cpu: float = 0.0
    lock_cpu: float = 0.0
    #: The lock server's commands over the timed rounds: name -> [calls, usec] (commandstats).
    lock_commands: dict[str, list[int]] = field(default_factory=dict)


# --------------------------------------------------------------------------- the fleet


class Fleet:
    """Celery worker processes started by this bench (and only those are ever stopped)."""

    def __init__(self, base_url: str, workers: int, concurrency: int, logdir: Path) -> None:
        self.base_url = base_url
        self.workers = workers
        self.concurrency = concurrency
        self.logdir = logdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, counters: redis.Redis, ready_key: str, urls: dict[str, str]) -> None:
        env = {**os.environ, **urls}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        nonce = secrets.token_hex(3)
        for i in range(self.workers):
            command = [
                sys.executable, "-m", "celery", "-A", APP_MODULE, "worker",
                "--loglevel", "WARNING",
                "--pool", "prefork",
                "--concurrency", str(self.concurrency),
                "--hostname", f"cbench{i}-{nonce}@%h",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            ]  # fmt: skip
            log = open(self.logdir / f"worker{i}.log", "ab")  # noqa: SIM115
            try:
                self.procs.append(
                    subprocess.Popen(
                        command,
                        cwd=REPO_ROOT,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group: ours to stop
                    )
                )
            finally:
                log.close()
        deadline = time.monotonic() + 120
        while int(counters.get(ready_key) or 0) < self.workers:
            dead = [p.pid for p in self.procs if p.poll() is not None]
            if dead:
                raise BenchError(f"worker(s) {dead} exited at start-up\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"workers not ready within 120 s\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, chars: int = 3000) -> str:
        parts = []
        for path in sorted(self.logdir.glob("worker*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM to each worker we started), then its process group if stuck."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # Not reaped yet, so its pid (and the group it leads: its pool) is still ours.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []


# --------------------------------------------------------------------------- measuring


def _wait_count(
    counters: redis.Redis, key: str, target: int, timeout: float, fleet: Fleet
) -> float:
    """Poll `key` until it reaches `target`; return the perf_counter time it was seen there."""
    deadline = time.monotonic() + timeout
    while True:
        if int(counters.get(key) or 0) >= target:
            return time.perf_counter()
        if time.monotonic() > deadline:
            got = int(counters.get(key) or 0)
            raise BenchError(f"{key}: {got} of {target} within {timeout:g} s\n{fleet.log_tail()}")
        if any(p.poll() is not None for p in fleet.procs):
            raise BenchError(f"a worker died during the run\n{fleet.log_tail()}")
        time.sleep(POLL)


def run_jobs(
    c: Contender,
    mod: ModuleType,
    counters: redis.Redis,
    fleet: Fleet,
    tag: str,
    jobs: int,
    timeout: float,
    drain: bool = False,
) -> tuple[float, float]:
    """Publish `jobs` distinct jobs; return (publish seconds, the run's seconds).

    Live (the default): the fleet consumes while one publisher feeds it; the run is publish
    start -> last body run, so a fleet faster than its publisher measures the publisher.
    Drain: the backlog is published first to a queue of its own that no worker consumes;
    then every worker is told to consume it (a broadcast add_consumer), and the run is that
    broadcast -> last body run: what the fleet can do, whatever one publisher can feed it.
    """
    queue = f"cbench-drain-{tag}" if drain else None
    publish = c.task.apply_async
    started = publish_started = time.perf_counter()
    if queue is None:
        for i in range(jobs):
            publish((tag, i))
    else:
        for i in range(jobs):
            publish((tag, i), queue=queue)
    published = time.perf_counter()
    if queue is not None:
        started = time.perf_counter()
        mod.app.control.add_consumer(queue, reply=False)
    try:
        done = _wait_count(counters, mod.EXEC_PREFIX + tag, jobs, timeout, fleet)
    finally:
        if queue is not None:  # an idle queue per round would slow every later poll
            mod.app.control.cancel_consumer(queue, reply=False)
    return published - publish_started, done - started


def _was_queued(c: Contender, result: Any, task_id: str) -> bool:
    """Did this publish reach the broker? The peers answer a duplicate without queueing it."""
    if c.name == ONCE:
        return not isinstance(result, EagerResult)  # a graceful duplicate: REJECTED, not sent
    if c.name == SINGLETON:
        return bool(result.id == task_id)  # a duplicate returns the queued task's result
    return True


def run_storm(
    c: Contender,
    mod: ModuleType,
    counters: redis.Redis,
    fleet: Fleet,
    tag: str,
    copies: int,
    timeout: float,
) -> tuple[int, int]:
    """Publish one job `copies` times while the fleet runs; return (queued, executions)."""
    queued = 0
    for _ in range(copies):
        task_id = uuid()
        result = c.task.apply_async((tag, 0), task_id=task_id)
        queued += _was_queued(c, result, task_id)
    _wait_count(counters, mod.HANDLED_PREFIX + tag, queued, timeout, fleet)
    return queued, int(counters.get(mod.EXEC_PREFIX + tag) or 0)


@dataclass
class Servers:
    """The bench's private redis-servers: the broker (and results); the lock server and the
    counters each one of their own, unless --one-server puts all on the broker's."""

    broker: Server
    locks: Server | None = None
    counters: Server | None = None

    def all(self) -> list[Server]:
        return [s for s in (self.broker, self.locks, self.counters) if s is not None]

    def stop(self) -> None:
        for server in self.all():
            server.stop()


def _base(server: Server) -> str:
    return server.url.rsplit("/", 1)[0]


def start_servers(args: argparse.Namespace) -> Servers:
    servers = Servers(start_private_redis(args.redis_server))
    try:
        if not args.one_server:
            servers.locks = start_private_redis(args.redis_server)
            servers.counters = start_private_redis(args.redis_server)
    except BenchError:
        servers.stop()
        raise
    return servers


def _commandstats(admin: redis.Redis) -> dict[str, tuple[int, int]]:
    """Each command's calls and microseconds so far (calls made from Lua included)."""
    stats: dict[str, dict[str, Any]] = admin.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for name, v in stats.items()
    }


def run(args: argparse.Namespace, servers: Servers, logdir: Path) -> dict[str, Any]:
    base_url = _base(servers.broker)
    urls = {"JOBFENCE_BENCH_REDIS_URL": base_url}
    if servers.locks is not None and servers.counters is not None:
        urls["JOBFENCE_BENCH_LOCK_URL"] = f"{_base(servers.locks)}/0"
        urls["JOBFENCE_BENCH_COUNTER_URL"] = f"{_base(servers.counters)}/0"
    os.environ.update(urls)  # read by the app module when imported below
    os.environ[BODY_ENV] = repr(args.body_ms)  # and this too, here and in every worker

    mod = importlib.import_module(APP_MODULE)
    if base_url != mod.BASE_URL or not math.isclose(mod.BODY_SECONDS * 1000, args.body_ms):
        raise BenchError(f"{APP_MODULE} was imported before the bench chose its server")
    counters = redis.Redis.from_url(mod.COUNTER_URL, socket_timeout=10.0)
    broker_admin = redis.Redis.from_url(f"{base_url}/0", socket_timeout=10.0)
    lock_admin = redis.Redis.from_url(mod.LOCK_URL, socket_timeout=10.0)
    fleet = Fleet(base_url, args.workers, args.concurrency, logdir)
    names = {**CONTENDERS, **({TRIPS: "plain_trips"} if args.round_trip_control else {})}
    contenders = [Contender(name, getattr(mod, attr)) for name, attr in names.items()]
    run_id = secrets.token_hex(4)
    try:
        fleet.start(counters, mod.READY_KEY, urls)
        for c in contenders:
            tag = f"warm-{names[c.name]}-{run_id}"
            run_jobs(c, mod, counters, fleet, tag, WARMUP_JOBS, 120)
        for r in range(args.rounds):
            shift = r % len(contenders)  # rotate the order so drift hits all alike
            for c in contenders[shift:] + contenders[:shift]:
                tag = f"jobs-{names[c.name]}-{run_id}-{r}"
                cpu = server_cpu(broker_admin), server_cpu(lock_admin)
                stats = _commandstats(lock_admin)
                pub, total = run_jobs(
                    c, mod, counters, fleet, tag, args.jobs, args.timeout, drain=args.drain
                )
                c.broker_cpu += server_cpu(broker_admin) - cpu[0]
                c.lock_cpu += server_cpu(lock_admin) - cpu[1]
                for name, (calls, usec) in _commandstats(lock_admin).items():
                    was = stats.get(name, (0, 0))
                    if calls > was[0]:
                        seen = c.lock_commands.setdefault(name, [0, 0])
                        seen[0] += calls - was[0]
                        seen[1] += usec - was[1]
                c.publish_seconds.append(pub)
                c.seconds.append(total)
                if not report_io.json_to_stdout(args):
                    print(
                        f"  round {r + 1}: {c.name:<32} {args.jobs / total:8.0f} jobs/s", flush=True
                    )
        for c in contenders:
            tag = f"{mod.STORM_TAG}{names[c.name]}-{run_id}"
            c.storm_queued, c.storm_executions = run_storm(
                c, mod, counters, fleet, tag, args.storm, args.timeout
            )
    finally:
        fleet.stop()
        for client in (counters, broker_admin, lock_admin):
            client.close()
    return build_report(args, contenders, servers)


# --------------------------------------------------------------------------- report


def _per_job_us(seconds: float, args: argparse.Namespace) -> float:
    return round(seconds / (int(args.jobs) * int(args.rounds)) * 1e6, 1)


def build_report(
    args: argparse.Namespace, contenders: list[Contender], servers: Servers
) -> dict[str, Any]:
    base = next(c for c in contenders if c.name == PLAIN)

    def vs_plain(c: Contender) -> list[float]:
        # Per-round ratios (the contenders ran side by side in time) resist load drift.
        return [b / s for b, s in zip(base.seconds, c.seconds, strict=True)]

    rows = [
        {
            "name": c.name,
            "jobs_per_s": round(args.jobs / statistics.median(c.seconds), 1),
            "jobs_per_s_min": round(args.jobs / max(c.seconds), 1),
            "jobs_per_s_max": round(args.jobs / min(c.seconds), 1),
            "jobs_per_s_rounds": [round(args.jobs / s, 1) for s in c.seconds],
            "publish_per_s": round(args.jobs / statistics.median(c.publish_seconds), 1),
            "vs_plain": round(statistics.median(vs_plain(c)), 3),
            "vs_plain_min": round(min(vs_plain(c)), 3),
            "vs_plain_max": round(max(vs_plain(c)), 3),
            "storm_queued": c.storm_queued,
            "storm_executions": c.storm_executions,
            "broker_cpu_us_per_job": _per_job_us(c.broker_cpu, args),
            "lock_cpu_us_per_job": _per_job_us(c.lock_cpu, args) if not args.one_server else None,
            "lock_commands_per_job": {
                name: {
                    "calls": round(calls / (args.jobs * args.rounds), 2),
                    "usec": round(usec / (args.jobs * args.rounds), 2),
                }
                for name, (calls, usec) in sorted(c.lock_commands.items(), key=lambda kv: -kv[1][1])
            },
        }
        for c in contenders
    ]
    by = {r["name"]: r for r in rows}
    jf = by[JOBFENCE]
    floor = BODY_TARGET if args.body_ms > 0 else TRIVIAL_TARGET
    lock_share = (
        None
        if args.one_server or not jf["broker_cpu_us_per_job"]
        else round(jf["lock_cpu_us_per_job"] / jf["broker_cpu_us_per_job"], 3)
    )
    targets = {
        f"jobfence_at_least_{floor:g}x_plain": jf["vs_plain"] >= floor,
        "jobfence_ahead_of_peers": all(
            jf["vs_plain"] > by[p]["vs_plain"] for p in (ONCE, SINGLETON)
        ),
    }
    if lock_share is not None:
        targets["lock_server_at_most_half_the_broker"] = lock_share <= LOCK_SHARE_TARGET
    return {
        "server": {
            "url": servers.broker.url,
            "locks": None if servers.locks is None else servers.locks.url,
            "counters": None if servers.counters is None else servers.counters.url,
        },
        "python": platform.python_version(),
        "versions": {"celery": celery.__version__, "redis-py": redis.__version__},
        "config": {
            "jobs": args.jobs,
            "storm": args.storm,
            "workers": args.workers,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "body_ms": args.body_ms,
            "mode": "drain" if args.drain else "live",
            "servers": "one" if args.one_server else "split",
            "round_trip_control": bool(args.round_trip_control),
            "pool": "prefork",
            "acks_late": True,
            "results": "ignored by every task (ignore_result=True); jobfence still writes "
            "its DONE record, which is its idempotency layer",
        },
        "contenders": rows,
        "jobfence_lock_cpu_vs_broker": lock_share,
        "targets": targets,
    }


def _body(ms: float) -> str:
    return f"time.sleep({ms:g} ms), then count" if ms > 0 else "trivial (count one execution)"


def _us(row: dict[str, Any]) -> str:
    lock = row["lock_cpu_us_per_job"]
    return "-" if lock is None else f"{lock:.1f}"


def _servers_line(report: dict[str, Any]) -> str:
    srv = report["server"]
    if srv.get("locks") is None:
        return f"private redis-server at {srv['url']} (broker, locks, results)"
    return (
        f"private redis-servers: broker and results {srv['url']}, locks {srv['locks']}, "
        f"the bench's counters {srv['counters']}"
    )


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    w = max(28, *(len(r["name"]) for r in report["contenders"]))  # the name column's width
    out = [
        "jobfence Celery benchmark",
        f"  celery {report['versions']['celery']}, redis-py {report['versions']['redis-py']}, "
        f"python {report['python']}; " + _servers_line(report),
        f"  fleet: {cfg['workers']} worker(s) x {cfg['concurrency']} prefork processes; "
        f"acks_late for all; results ignored by all",
        "",
        f"{cfg['jobs']} distinct jobs per contender, median of {cfg['rounds']} interleaved "
        + (
            "round(s), drain: the backlog published first, then consumed, "
            "fleet told to consume -> last body run;"
            if cfg.get("mode") == "drain"
            else "round(s), publish start -> last body run;"
        ),
        f"body: {_body(cfg['body_ms'])}; "
        f"storm: one job published {cfg['storm']} times while the fleet runs",
        "",
        f"  {'contender':<{w}} {'jobs/s':>8} {'(min-max)':>13} {'publish/s':>10} "
        f"{'vs plain':>9} {'(min-max)':>11} {'storm: queued':>14} {'executions':>11} "
        f"{'broker µs/job':>14} {'locks µs/job':>13}",
    ]
    for r in report["contenders"]:
        jobs = f"({r['jobs_per_s_min']:.0f}-{r['jobs_per_s_max']:.0f})"
        ratio = f"({r['vs_plain_min']:.2f}-{r['vs_plain_max']:.2f})"
        out.append(
            f"  {r['name']:<{w}} {r['jobs_per_s']:>8.0f} {jobs:>13} {r['publish_per_s']:>10.0f} "
            f"{r['vs_plain']:>8.2f}x {ratio:>11} {r['storm_queued']:>14} "
            f"{r['storm_executions']:>11} {r['broker_cpu_us_per_job']:>14.1f} {_us(r):>13}"
        )
    t = report["targets"]
    jf = next(r for r in report["contenders"] if r["name"] == JOBFENCE)
    floor = BODY_TARGET if cfg["body_ms"] > 0 else TRIVIAL_TARGET
    out += [
        "  vs plain: median over rounds of plain's round time / this contender's (>1 faster);",
        "  (min-max): the slowest and fastest round; broker / locks µs/job: each server's main-"
        "thread CPU (INFO cpu) over the timed rounds, per job",
        "",
        "targets",
        f"  @singleton_task >= {floor:g}x plain Celery: {jf['vs_plain']:.2f}x  "
        f"{'MET' if t[f'jobfence_at_least_{floor:g}x_plain'] else 'MISSED'}",
        f"  ahead of celery-once and celery-singleton: "
        f"{'MET' if t['jobfence_ahead_of_peers'] else 'MISSED'}",
    ]
    commands = jf.get("lock_commands_per_job") or {}
    if commands and report["server"].get("locks") is not None:
        out.append("  jobfence's commands on the lock server per job (calls, command µs):")
        out.append("    " + ", ".join(
            f"{name} {v['calls']:g} / {v['usec']:.1f}" for name, v in list(commands.items())[:8]
        ))  # fmt: skip
    share = report.get("jobfence_lock_cpu_vs_broker")
    if share is not None:
        out.append(
            f"  lock server CPU per job <= {LOCK_SHARE_TARGET:g}x the broker's: {share:.2f}x  "
            f"{'MET' if t['lock_server_at_most_half_the_broker'] else 'MISSED'}"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobfence bench celery",
        description="Jobs/s and duplicate storms: plain Celery, jobfence, celery-once, "
        "celery-singleton on one fleet of real worker processes.",
    )
    p.add_argument("--jobs", type=int, default=5000, help="distinct jobs per round (5000)")
    p.add_argument("--storm", type=int, default=1000, help="copies of the storm job (1000)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (2)")
    p.add_argument("--concurrency", type=int, default=2, help="pool size per worker (2)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per contender (3)")
    p.add_argument(
        "--body-ms",
        type=float,
        default=0.0,
        help="every body first waits this many ms in time.sleep, as I/O would (default 0: "
        f"trivial; the target is then {BODY_TARGET}x plain)",
    )
    p.add_argument(
        "--drain",
        action="store_true",
        help="publish each round's backlog before the fleet consumes it and time the fleet "
        "alone (default: live, one publisher feeding a consuming fleet)",
    )
    p.add_argument(
        "--round-trip-control",
        action="store_true",
        help="add a control: plain Celery whose body first makes two bare round trips (PING), "
        "as many as a jobfence job makes in its pool process",
    )
    p.add_argument(
        "--one-server",
        action="store_true",
        help="broker, locks and counters on one private redis-server (default: the lock "
        "server and the counters each on one of their own, each server's CPU per job apart)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a phase may take")
    report_io.add_private_redis_args(p)
    args = p.parse_args(argv)
    for name in ("jobs", "storm", "workers", "concurrency", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if not 0 <= args.body_ms <= 60_000:
        p.error("--body-ms must be between 0 and 60000")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if --check and a target is missed, 2 on failure."""
    args = parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="jobfence-celery-bench-"))
    try:
        servers = start_servers(args)
    except BenchError as exc:
        print(f"bench: cannot start a private redis-server: {exc}", file=sys.stderr)
        return 2
    try:
        if not report_io.json_to_stdout(args):
            print(f"running on private redis-server at {servers.broker.url} ...", flush=True)
        report = run(args, servers, logdir)
    except (BenchError, redis.RedisError) as exc:
        print(f"bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        servers.stop()
        shutil.rmtree(logdir, ignore_errors=True)
    print(json.dumps(report) if report_io.json_to_stdout(args) else format_report(report))
    report_io.write_report("celery", report, png=charts.celery_chart, args=args)
    if args.check and not all(report["targets"].values()):
        return 1
    return 0


_: Callable[[list[str] | None], int] = main  # the signature `python -m jobfence bench` calls

if __name__ == "__main__":
    sys.exit(main())
