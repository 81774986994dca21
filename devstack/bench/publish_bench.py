"""Publish benchmark: what `apply_async` costs the publisher, @singleton_task beside plain Celery.

One process publishes to a private redis-server (the broker, and the lock server of every
contender that locks at publish), in interleaved rounds of distinct jobs, the same task body:
  plain                     a plain Celery task
  jobfence                  @singleton_task (its identity: binding, canonical JSON, HMAC)
  jobfence, dedupe          @singleton_task(dedupe_on_publish=True): one claim script more
  celery-once               QueueOnce (a lock taken at publish)
  celery-singleton          Singleton (a lock taken at publish)
per publish: wall µs, this process's CPU µs, and the round trips (counted in an untimed pass
after the rounds, as the writes redis-py's connections send: kombu's Redis transport, the
peers and jobfence's lane all write through them; a pipeline is one). The queue is emptied
between rounds. Issue 23's targets:
jobfence's publish CPU at most 1.03x plain's, and dedupe_on_publish at most one round trip
more than jobfence without it.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import celery
import redis

from devstack.bench import report as report_io
from jobfence.config import Settings
from jobfence.tasks import install, singleton_task

CPU_TARGET = 1.03  # jobfence's publish CPU over plain Celery's
EXTRA_TRIPS_TARGET = 1.0  # round trips dedupe_on_publish adds to a publish
TRIP_PUBLISHES = 200  # publishes per case in the round-trip counting pass
QUEUE = "pbench"
SECRET = "publish-bench-secret-not-for-production"
PLAIN = "plain Celery task"
JOBFENCE = "jobfence @singleton_task"
DEDUPE = "jobfence, dedupe_on_publish"
ONCE = "celery-once QueueOnce"
SINGLETON = "celery-singleton Singleton"


class PublishBenchError(RuntimeError):
    """The benchmark could not run, or a publish did not do what it must."""


def body(tag: str, n: int) -> int:
    """Every contender's body (never run here: the bench only publishes)."""
    return n


@dataclass
class Case:
    name: str
    task: Any
    wall: list[float] = field(default_factory=list)  # seconds per round
    cpu: list[float] = field(default_factory=list)
    trips: int = 0  # round trips of the counting pass


def build_app(url: str) -> tuple[celery.Celery, dict[str, Any], Callable[[], None]]:
    """The app on the private server (broker db 0, locks db 1) and its five tasks; the last
    item closes the runtime."""
    from celery_once import QueueOnce
    from celery_singleton import Singleton

    base = url.rstrip("/")
    if base.count("/") > 2 and base.rsplit("/", 1)[1].isdigit():  # redis://host:port/N
        base = base.rsplit("/", 1)[0]
    locks = f"{base}/1"
    app = celery.Celery("pbench", broker=f"{base}/0", set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
        ONCE={"backend": "celery_once.backends.Redis",
              "settings": {"url": locks, "default_timeout": 600}},
        singleton_backend_url=locks,
        singleton_key_prefix="pbench-singleton:",
        singleton_lock_expiry=600,
    )  # fmt: skip
    runtime = install(app, Settings(lock_url=locks, key_prefix="pbench", key_secret=SECRET))
    app.task(name="pbench.plain", acks_late=True)(body)
    singleton_task(app=app, name="pbench.jobfence")(body)
    singleton_task(app=app, name="pbench.dedupe", dedupe_on_publish=True)(body)
    app.task(name="pbench.once", base=QueueOnce, once={"graceful": True}, acks_late=True)(body)
    app.task(name="pbench.singleton", base=Singleton, acks_late=True)(body)
    app.finalize()
    tasks = {
        PLAIN: app.tasks["pbench.plain"],
        JOBFENCE: app.tasks["pbench.jobfence"],
        DEDUPE: app.tasks["pbench.dedupe"],
        ONCE: app.tasks["pbench.once"],
        SINGLETON: app.tasks["pbench.singleton"],
    }
    return app, tasks, runtime.close


@contextmanager
def counting_writes() -> Iterator[list[int]]:
    """Count every write redis-py's connections send (each a round trip) while inside."""
    from redis.connection import AbstractConnection

    count = [0]
    send = AbstractConnection.send_packed_command

    def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        count[0] += 1
        send(self, command, check_health)  # type: ignore[no-untyped-call]

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]


def run(url: str, *, publishes: int, rounds: int, warmup: int) -> list[Case]:
    """Interleaved rounds (each starts at another case) of `publishes` new jobs per case."""
    app, tasks, close = build_app(url)
    admin = redis.Redis.from_url(url, decode_responses=True)
    jobs = itertools.count()
    cases = [Case(name, task) for name, task in tasks.items()]
    try:
        with app.producer_or_acquire() as producer:  # one connection, as a web process keeps

            def publish(case: Case, n: int) -> None:
                for _ in range(n):
                    case.task.apply_async(("bench", next(jobs)), producer=producer)

            for case in cases:
                publish(case, warmup)
            admin.delete(QUEUE)
            for r in range(rounds):
                for case in cases[r % len(cases):] + cases[: r % len(cases)]:
                    gc.collect()
                    cpu, started = time.process_time(), time.perf_counter()
                    publish(case, publishes)
                    case.wall.append(time.perf_counter() - started)
                    case.cpu.append(time.process_time() - cpu)
                    if int(admin.llen(QUEUE)) != publishes:
                        raise PublishBenchError(
                            f"{case.name}: {admin.llen(QUEUE)} messages queued of {publishes}"
                        )
                    admin.delete(QUEUE)
            for case in cases:  # untimed: the counter costs a call per write
                with counting_writes() as count:
                    publish(case, TRIP_PUBLISHES)
                case.trips = count[0]
            admin.delete(QUEUE)
    finally:
        admin.close()
        close()
    return cases


def _us(seconds: float, n: int) -> float:
    return round(seconds / n * 1e6, 2)


def build_report(url: str, version: str, cases: list[Case], *, publishes: int, rounds: int,
                 warmup: int) -> dict[str, Any]:  # fmt: skip
    by = {c.name: c for c in cases}
    plain, jf, dedupe = by[PLAIN], by[JOBFENCE], by[DEDUPE]
    # Ratios per round (neighbours in time) resist a shared box's drift.
    cpu_ratios = [j / p for j, p in zip(jf.cpu, plain.cpu, strict=True)]
    extra_trips = (dedupe.trips - jf.trips) / TRIP_PUBLISHES
    rows = [
        {
            "name": c.name,
            "us_per_publish": _us(statistics.median(c.wall), publishes),
            "cpu_us_per_publish": _us(statistics.median(c.cpu), publishes),
            "cpu_us_min": _us(min(c.cpu), publishes),
            "cpu_us_max": _us(max(c.cpu), publishes),
            "cpu_vs_plain": round(
                statistics.median(x / p for x, p in zip(c.cpu, plain.cpu, strict=True)), 3
            ),
            "round_trips_per_publish": round(c.trips / TRIP_PUBLISHES, 3),
        }
        for c in cases
    ]
    cpu_ratio = statistics.median(cpu_ratios)
    return {
        "server": {"url": url, "redis_version": version},
        "python": platform.python_version(),
        "versions": {"celery": celery.__version__, "redis-py": redis.__version__},
        "config": {"publishes_per_round": publishes, "rounds": rounds, "warmup": warmup},
        "rows": rows,
        "jobfence_cpu_ratio": round(cpu_ratio, 3),
        "jobfence_cpu_ratio_min": round(min(cpu_ratios), 3),
        "jobfence_cpu_ratio_max": round(max(cpu_ratios), 3),
        "dedupe_extra_trips": round(extra_trips, 3),
        "targets": {
            "jobfence_publish_cpu_within_1_03x_plain": cpu_ratio <= CPU_TARGET,
            "dedupe_at_most_one_round_trip_more": extra_trips <= EXTRA_TRIPS_TARGET,
        },
    }


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    out = [
        "jobfence publish benchmark",
        f"  server  private redis-server {report['server']['redis_version']} at "
        f"{report['server']['url']} (broker and locks)",
        f"  python  {report['python']}, celery {report['versions']['celery']}, "
        f"redis-py {report['versions']['redis-py']}",
        "",
        f"one process, one producer connection, {cfg['warmup']} warm-up publishes per case, "
        f"median of {cfg['rounds']} interleaved rounds x {cfg['publishes_per_round']} new jobs",
        "",
        f"  {'contender':<30} {'µs':>7} {'cpu µs':>8} {'(min-max)':>11} {'cpu/plain':>9} "
        f"{'round trips':>12}",
    ]
    for r in report["rows"]:
        spread = f"({r['cpu_us_min']:.0f}-{r['cpu_us_max']:.0f})"
        out.append(
            f"  {r['name']:<30} {r['us_per_publish']:>7.1f} {r['cpu_us_per_publish']:>8.1f} "
            f"{spread:>11} {r['cpu_vs_plain']:>8.2f}x {r['round_trips_per_publish']:>12g}"
        )
    t = report["targets"]
    out += [
        "  cpu µs: this process's CPU per publish (the server's is apart, on the same box);",
        "  cpu/plain: the median over rounds of this contender's CPU over plain's in that round",
        "",
        "targets",
        f"  jobfence's publish CPU within {CPU_TARGET}x plain's: "
        f"{report['jobfence_cpu_ratio']:.3f}x (rounds {report['jobfence_cpu_ratio_min']:.2f}-"
        f"{report['jobfence_cpu_ratio_max']:.2f}x)"
        f"  {'MET' if t['jobfence_publish_cpu_within_1_03x_plain'] else 'MISSED'}",
        f"  dedupe_on_publish at most one round trip more: {report['dedupe_extra_trips']:g} more"
        f"  {'MET' if t['dedupe_at_most_one_round_trip_more'] else 'MISSED'}",
    ]
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobfence bench publish",
        description="What apply_async costs the publisher: @singleton_task beside plain Celery "
        "and the peers that lock at publish.",
    )
    p.add_argument("--publishes", type=int, default=2000,
                   help="new jobs published per case and round (default 2000)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=9, help="timed rounds per case (default 9)")
    p.add_argument("--warmup", type=int, default=300, help="warm-up publishes per case (300)")
    report_io.add_private_redis_args(p)
    args = p.parse_args(argv)
    if args.publishes < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--publishes and --rounds must be at least 1, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if --check and a target is missed, 2 on failure."""
    args = parse_args(argv)

    def measure(url: str, version: str) -> dict[str, Any]:
        cases = run(url, publishes=args.publishes, rounds=args.rounds, warmup=args.warmup)
        return build_report(url, version, cases, publishes=args.publishes, rounds=args.rounds,
                            warmup=args.warmup)  # fmt: skip

    return report_io.main_on_private_redis("publish", args, measure, format_report,
                                           errors=(PublishBenchError,))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
