"""Keeper benchmark: one LeaseKeeper holding many leases on a private redis-server.

It takes `--leases` leases (default 10,000) one after another, as jobs would start, hands
each to one LeaseKeeper, and then watches a window of `--seconds`. The report gives, per
keeper interval (TTL/3): the round trips the keeper made to the server (extend_many calls,
each one write and one read on one connection), the scripts those carried, the server's
time in them (INFO commandstats) and its process CPU (INFO cpu); and the client process's
CPU as a share of one core over the window (time.process_time: the keeper's threads, the
main thread only sleeps). A short TTL scales the interval down, so a few seconds hold many
intervals.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from devstack.redis_server import RedisServer
from jobfence.config import Settings
from jobfence.locks import Lease, LeaseKeeper, RedisBackend

PREFIX = "kbench"
TARGET_CPU = 0.05  # of one core
TARGET_TRIPS = 1.0  # round trips per interval per server
DEFAULT_INTERVAL = Settings().heartbeat_interval  # the keeper's interval with default settings


class KeeperBenchError(RuntimeError):
    """The benchmark could not run, or the keeper lost a lease it should have kept."""


class CountingBackend(RedisBackend):
    """Counts extend_many calls (one round trip each) and the leases they carried."""

    calls = 0
    extended = 0
    _count_lock = threading.Lock()

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        with self._count_lock:
            self.calls += 1
            self.extended += len(items)
        return super()._extend_many(items)


def _server(admin: redis.Redis) -> tuple[dict[str, Any], float]:
    cpu = admin.info("cpu")
    stats = dict(admin.info("commandstats")).get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return stats, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def take(backend: RedisBackend, keeper: LeaseKeeper, n: int, ttl: float) -> list[Lease]:
    """`n` leases taken one by one and kept, as `n` jobs starting would."""
    held = []
    for i in range(n):
        lease = backend.try_acquire(f"lease:{i}", ttl)
        if lease is None:
            raise KeeperBenchError("a free key was refused")
        keeper.keep(lease)
        held.append(lease)
    return held


def run(url: str, *, leases: int, ttl: float, seconds: float) -> dict[str, Any]:
    backend = CountingBackend(
        RedisBackend.client_for(url, socket_timeout=max(2.0, ttl / 2)), prefix=PREFIX
    )
    admin = redis.Redis.from_url(url, decode_responses=True)
    lost: list[Lease] = []
    keeper = LeaseKeeper(on_lost=lambda lease, _exc: lost.append(lease))
    try:
        started = time.monotonic()
        held = take(backend, keeper, leases, ttl)
        taking = time.monotonic() - started
        time.sleep(ttl / 3 * 1.5)  # past the first extension of the last lease
        calls, extended = backend.calls, backend.extended
        stats, cpu = _server(admin)
        t0, c0 = time.monotonic(), time.process_time()
        time.sleep(seconds)
        wall, client_cpu = time.monotonic() - t0, time.process_time() - c0
        stats2, cpu2 = _server(admin)
        window_calls, window_extended = backend.calls - calls, backend.extended - extended
        if lost:
            raise KeeperBenchError(f"the keeper lost {len(lost)} lease(s)")
        if not all(le.held for le in held):
            raise KeeperBenchError("a lease is no longer held")
        intervals = wall / (ttl / 3)
        return {
            "leases": leases,
            "ttl": ttl,
            "interval": ttl / 3,
            "window_seconds": wall,
            "intervals": intervals,
            "taking_seconds": taking,
            "round_trips_per_interval": window_calls / intervals,
            "leases_per_round_trip": window_extended / max(1, window_calls),
            "extensions_per_lease_per_interval": window_extended / leases / intervals,
            "scripts_per_interval": (int(stats2["calls"]) - int(stats["calls"])) / intervals,
            "server_usec_per_interval": (int(stats2["usec"]) - int(stats["usec"])) / intervals,
            "server_cpu_usec_per_interval": (cpu2 - cpu) * 1e6 / intervals,
            "client_cpu_share": client_cpu / wall,
            "client_cpu_ms_per_interval": client_cpu * 1000 / intervals,
            "client_cpu_share_at_default_ttl": client_cpu / intervals / DEFAULT_INTERVAL,
            "lost": len(lost),
        }
    finally:
        keeper.stop()
        admin.close()
        backend.close()


def format_report(report: dict[str, Any]) -> str:
    r = report["run"]
    ok = report["targets"]
    return "\n".join([
        f"keeper bench: {r['leases']} leases kept by one LeaseKeeper, TTL {r['ttl']:g}s, "
        f"interval {r['interval']:.2f}s, window {r['window_seconds']:.1f}s = "
        f"{r['intervals']:.1f} intervals (redis {report['redis_version']}, python "
        f"{report['python']})",
        "",
        f"  round trips per interval     {r['round_trips_per_interval']:.2f}   "
        f"({r['leases_per_round_trip']:.0f} leases each; target {TARGET_TRIPS:g})",
        f"  extensions per lease         {r['extensions_per_lease_per_interval']:.2f} per "
        "interval",
        f"  scripts per interval         {r['scripts_per_interval']:.2f}   (EVALSHA, in the "
        "round trips above)",
        f"  server usec per interval     {r['server_usec_per_interval']:.0f}   (INFO "
        f"commandstats; {r['server_usec_per_interval'] / r['leases']:.2f} per lease)",
        f"  server CPU usec per interval {r['server_cpu_usec_per_interval']:.0f}   (INFO cpu)",
        f"  client CPU                   {100 * r['client_cpu_share']:.2f}% of one core   "
        f"(target < {100 * TARGET_CPU:g}%; the keeper's threads over the window), "
        f"{r['client_cpu_ms_per_interval']:.0f} ms per interval",
        f"  client CPU, default settings {100 * r['client_cpu_share_at_default_ttl']:.2f}% of one "
        f"core   (the same work once per {DEFAULT_INTERVAL:g}s interval)",
        f"  leases lost                  {r['lost']}",
        f"  (taking the leases took {r['taking_seconds']:.1f}s, before the window)",
        "",
        "  targets: " + ", ".join(f"{name} {'met' if v else 'MISSED'}" for name, v in ok.items()),
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobfence bench keeper",
        description="Round trips, server time and client CPU of one keeper holding many leases.",
    )
    p.add_argument("--leases", type=int, default=10000, help="leases kept (default 10000)")
    p.add_argument("--ttl", type=float, default=6.0,
                   help="lease TTL in seconds; the keeper extends every TTL/3 (default 6)")
    p.add_argument("--seconds", type=float, default=30.0, help="measured window (default 30)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    args = p.parse_args(argv)
    if args.leases < 1 or args.ttl <= 0 or args.seconds <= 0:
        p.error("--leases, --ttl and --seconds must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with RedisServer(executable=args.redis_server) as server:
        version = str(server.client().info("server")["redis_version"])
        result = run(server.url, leases=args.leases, ttl=args.ttl, seconds=args.seconds)
    report: dict[str, Any] = {
        "bench": "keeper",
        "redis_version": version,
        "python": platform.python_version(),
        "run": result,
        "targets": {
            "one_round_trip_per_interval": result["round_trips_per_interval"]
            <= TARGET_TRIPS + 0.5,
            "under_5pct_of_a_core": result["client_cpu_share"] < TARGET_CPU,
        },
    }
    print(json.dumps(report) if args.json else format_report(report))
    if args.check and not all(report["targets"].values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
