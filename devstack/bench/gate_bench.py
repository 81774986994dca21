"""Gate benchmark: one gated @singleton_task call in one process against the bare lock pair.

On a private redis-server, in one process, interleaved rounds of:
  pair     RedisBackend.try_acquire + Lease.release (two round trips, no task layer)
  gated    a trivial @singleton_task called as the worker's tracer calls it (request pushed,
           `task(*args)`, request popped): binding, canonical JSON, HMAC, the executor's
           begin and commit, keeper, metrics, context
  plain    the same body as a plain Celery task, called the same way: the gate's own cost is
           gated - plain (the tracer's request push and pop are paid without jobfence too)
and, for where the time goes, the pieces apart: the identity (binding + JSON + HMAC),
begin+commit alone, and the executor with a ready JobSpec.
`--profile` adds the top functions of the gated path (pyinstrument if installed, else cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.metadata
import io
import itertools
import platform
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.utils
from celery import Celery
from celery.app.trace import task_has_custom

from devstack.bench import charts
from devstack.bench import report as report_io
from jobfence.config import Settings
from jobfence.locks import Lease, RedisBackend
from jobfence.locks.errors import LockError
from jobfence.tasks import Runtime, install, singleton_task
from jobfence.tasks.executor import JobSpec

TARGET_RATIO = 1.6  # a gated call costs at most this many bare acquire+release pairs (issue 33)
PREFIX = "gbench"
PAIR_TTL = 30.0
SECRET = "gate-bench-secret-not-for-production"
PAIR = "pair: try_acquire + release"
GATED = "gated @singleton_task call"
PLAIN = "plain Celery task call"
IDENTITY = "identity (bind, JSON, HMAC)"
BEGIN_COMMIT = "begin + commit (job scripts)"
EXECUTOR = "executor.run (ready JobSpec)"


class GateBenchError(RuntimeError):
    """The benchmark could not run, or a call did not do what a trivial job must."""


def trivial(n: int) -> int:
    """The body of every task here: as little as a job can do."""
    return n


@dataclass
class Case:
    name: str
    call: Callable[[], None]
    seconds: list[float] = field(default_factory=list)  # wall time of each round
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU per round


def _time(call: Callable[[], None], n: int) -> tuple[float, float]:
    cpu = time.process_time()
    started = time.perf_counter()
    for _ in range(n):
        call()
    return time.perf_counter() - started, time.process_time() - cpu


def as_worker_calls(task: Any, args: tuple[Any, ...]) -> Any:
    """Call `task` as celery.app.trace does in a worker: a request pushed, `task(*args)`."""
    request = {
        "id": str(uuid.uuid4()),
        "task": task.name,
        "delivery_info": {"exchange": "", "routing_key": "celery", "redelivered": False},
        "headers": None,
    }
    # The tracer calls `task` itself only if its class overrides __call__ (SingletonTask
    # does), else `task.run`: Celery's own __call__ would push a second request.
    fun = task if task_has_custom(task, "__call__") else task.run
    task.push_request(request, args=args, kwargs={}, called_directly=False)
    try:
        return fun(*args)
    finally:
        task.pop_request()


class Bench:
    """The app, runtime, tasks and backends of one run, on one private server."""

    def __init__(self, url: str) -> None:
        self.settings = Settings(lock_url=url, key_prefix=PREFIX, key_secret=SECRET)
        self.app = Celery("gbench", set_as_current=False)
        self.app.conf.update(task_serializer="json", accept_content=["json"])
        self.runtime: Runtime = install(self.app, self.settings)
        singleton_task(app=self.app, name="gbench.trivial")(trivial)
        self.app.task(name="gbench.plain", acks_late=True)(trivial)
        self.app.finalize()  # as a worker does: real task objects, not lazy proxies
        self.gated = self.app.tasks["gbench.trivial"]
        self.plain = self.app.tasks["gbench.plain"]
        self.pair_backend = RedisBackend.from_url(url, prefix=PREFIX)
        self.jobs = itertools.count(1)  # every job is new: a DONE record would replay it

    def close(self) -> None:
        self.runtime.close()
        self.pair_backend.close()

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the cases ---------------------------------------------------------------
    def pair(self) -> None:
        lease = self.pair_backend.try_acquire("pair", PAIR_TTL)
        if lease is None or not lease.release():
            raise GateBenchError("the bare pair was refused on a free key")

    def gated_call(self) -> None:
        n = next(self.jobs)
        if as_worker_calls(self.gated, (n,)) != n:
            raise GateBenchError("a gated call did not return its body's result")

    def plain_call(self) -> None:
        n = next(self.jobs)
        if as_worker_calls(self.plain, (n,)) != n:
            raise GateBenchError("a plain call did not return its body's result")

    def identity(self) -> None:
        self.gated.identity((next(self.jobs),), {})

    def begin_commit(self) -> None:
        backend = self.runtime.backend
        key = f"gbench.raw:{next(self.jobs)}"
        got = backend.begin(key, PAIR_TTL, record=True, fingerprint="fp")
        if not isinstance(got, Lease):
            raise GateBenchError(f"begin refused a new job: {got!r}")
        if not backend.commit(got, state="DONE", result="1", fingerprint="fp", result_ttl=600):
            raise GateBenchError("commit found another owner")

    def executor_run(self) -> None:
        n = next(self.jobs)
        spec = JobSpec(
            name="gbench.executor",
            key=f"gbench.executor:{n}",
            fingerprint="fp",
            ttl=self.settings.default_ttl,
            result_ttl=self.settings.result_ttl,
            task_id=str(n),
        )
        out = self.runtime.executor.run(spec, lambda _ctx: n)
        if out.status != "ran":
            raise GateBenchError(f"executor did not run a new job: {out.status}")

    def cases(self, pieces: bool) -> list[Case]:
        out = [Case(PAIR, self.pair), Case(GATED, self.gated_call), Case(PLAIN, self.plain_call)]
        if pieces:
            out += [
                Case(IDENTITY, self.identity),
                Case(BEGIN_COMMIT, self.begin_commit),
                Case(EXECUTOR, self.executor_run),
            ]
        return out


def run(bench: Bench, *, calls: int, rounds: int, warmup: int, pieces: bool = True) -> list[Case]:
    """Interleaved rounds (each round starts at another case), after a warm-up of each."""
    cases = bench.cases(pieces)
    for case in cases:
        _time(case.call, warmup)
    for r in range(rounds):
        for case in cases[r % len(cases) :] + cases[: r % len(cases)]:
            gc.collect()
            wall, cpu = _time(case.call, calls)
            case.seconds.append(wall)
            case.cpu_seconds.append(cpu)
    return cases


def profile(bench: Bench, *, calls: int, top: int = 25) -> dict[str, Any]:
    """The gated path's top functions: pyinstrument's tree if installed, else cProfile's table."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        prof = cProfile.Profile()
        prof.enable()
        _time(bench.gated_call, calls)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        return {"tool": "cProfile, by own time", "calls": calls, "text": text.getvalue()}
    profiler = Profiler(interval=0.0001)
    profiler.start()
    _time(bench.gated_call, calls)
    profiler.stop()
    return {
        "tool": "pyinstrument",
        "calls": calls,
        "text": profiler.output_text(unicode=False, color=False, show_all=False),
    }


# --------------------------------------------------------------------------- report


def _us(seconds: float, calls: int) -> float:
    return round(seconds / calls * 1e6, 2)


def build_report(
    url: str, version: str, cases: list[Case], *, calls: int, rounds: int, warmup: int
) -> dict[str, Any]:
    by = {c.name: c for c in cases}
    pair, gated, plain = by[PAIR], by[GATED], by[PLAIN]
    # Per-round ratios (same round, neighbouring in time) resist load drift on a shared box.
    # The gate's own cost leaves out what a plain task costs in the same tracer (Celery's
    # request push and pop, the body): a worker pays that with or without jobfence.
    raw = [g / p for g, p in zip(gated.seconds, pair.seconds, strict=True)]
    ratios = [
        (g - b) / p for g, b, p in zip(gated.seconds, plain.seconds, pair.seconds, strict=True)
    ]
    rows = [
        {
            "name": c.name,
            "us_per_call": _us(statistics.median(c.seconds), calls),
            "us_min": _us(min(c.seconds), calls),
            "us_max": _us(max(c.seconds), calls),
            "cpu_us_per_call": _us(statistics.median(c.cpu_seconds), calls),
        }
        for c in cases
    ]
    ratio = statistics.median(ratios)
    return {
        "server": {"url": url, "redis_version": version},
        "python": platform.python_version(),
        "versions": {"redis-py": redis.__version__, "hiredis": _hiredis_version()},
        "config": {"calls_per_round": calls, "rounds": rounds, "warmup_calls": warmup},
        "rows": rows,
        "ratio": round(ratio, 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "raw_ratio": round(statistics.median(raw), 3),
        "gate_us": round(
            statistics.median(g - b for g, b in zip(gated.seconds, plain.seconds, strict=True))
            / calls * 1e6,
            2,
        ),
        "over_pair_us": round(
            statistics.median(
                g - b - p
                for g, b, p in zip(gated.seconds, plain.seconds, pair.seconds, strict=True)
            )
            / calls * 1e6,
            2,
        ),
        "targets": {"gated_call_within_1_6x_pair": ratio <= TARGET_RATIO},
    }


def _hiredis_version() -> str | None:
    """The hiredis redis-py parses replies with, or None if it uses its Python parser."""
    if not redis.utils.HIREDIS_AVAILABLE:
        return None
    try:
        return importlib.metadata.version("hiredis")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    out = [
        "jobfence gate benchmark",
        f"  server  private redis-server {report['server']['redis_version']} at "
        f"{report['server']['url']}",
        f"  python  {report['python']}, redis-py {report['versions']['redis-py']}, "
        f"hiredis {report['versions']['hiredis'] or 'not installed'}",
        "",
        f"one process, sequential calls, {cfg['warmup_calls']} warm-up calls per case, "
        f"median of {cfg['rounds']} interleaved rounds x {cfg['calls_per_round']} calls",
        "",
        f"  {'case':<32} {'µs/call':>8} {'(min-max)':>13} {'cpu µs':>8}",
    ]
    for r in report["rows"]:
        spread = f"({r['us_min']:.0f}-{r['us_max']:.0f})"
        out.append(
            f"  {r['name']:<32} {r['us_per_call']:>8.1f} {spread:>13} {r['cpu_us_per_call']:>8.1f}"
        )
    out += [
        "  cpu µs: this process's CPU per call (the server's is apart, on the same box)",
        "  plain: the same body as a plain Celery task in the same tracer (request push, pop);",
        "  the rows after it are pieces of the gated call, timed alone",
        "",
        f"the gate (gated call - plain call): {report['gate_us']:.1f} µs, "
        f"{report['ratio']:.2f}x the pair (rounds {report['ratio_min']:.2f}-"
        f"{report['ratio_max']:.2f}x),",
        f"  {report['over_pair_us']:.1f} µs more than the pair's two round trips; "
        f"gated call / pair with Celery's part: {report['raw_ratio']:.2f}x",
        "",
        "targets",
        f"  the gate within {TARGET_RATIO}x the bare pair: {report['ratio']:.2f}x  "
        f"{'MET' if report['targets']['gated_call_within_1_6x_pair'] else 'MISSED'}",
    ]
    if "profile" in report:
        p = report["profile"]
        out += ["", f"profile of {p['calls']} gated calls ({p['tool']})", p["text"].rstrip()]
    return "\n".join(out)


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobfence bench gate",
        description="The task layer's own cost: a gated call against the bare lock pair.",
    )
    p.add_argument("--calls", type=int, default=2000, help="calls per round (default 2000)")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds per case (default 9)")
    p.add_argument("--warmup", type=int, default=500, help="warm-up calls per case (default 500)")
    p.add_argument("--no-pieces", action="store_true", help="time only the pair and the call")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile N gated calls after the rounds (pyinstrument if installed; default 0)",
    )
    report_io.add_private_redis_args(p)
    args = p.parse_args(argv)
    for name in ("calls", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0 or args.profile < 0:
        p.error("--warmup and --profile must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if --check and the target is missed, 2 on failure."""
    args = parse_args(argv)

    def measure(url: str, version: str) -> dict[str, Any]:
        with Bench(url) as bench:
            cases = run(bench, calls=args.calls, rounds=args.rounds, warmup=args.warmup,
                        pieces=not args.no_pieces)  # fmt: skip
            report = build_report(
                url, version, cases, calls=args.calls, rounds=args.rounds, warmup=args.warmup
            )
            if args.profile:
                report["profile"] = profile(bench, calls=args.profile)
        return report

    return report_io.main_on_private_redis("gate", args, measure, format_report,
                                           errors=(GateBenchError, LockError),
                                           png=charts.gate_chart)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
