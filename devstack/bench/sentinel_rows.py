"""The lock benchmark's Sentinel row: pairs on the master the sentinels name, beside one node."""

from __future__ import annotations

import gc
import statistics
from typing import Any

import redis

from devstack.bench.redlock_rows import CLIENT_OPTIONS, Row, _jobfence_row, _time
from devstack.local_sentinel import LocalSentinel
from jobfence.locks import RedisBackend
from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend

PREFIX = "stbench"
SINGLE = "jobfence Redis, 1 node"
SENTINEL = "jobfence Sentinel master"


def run(
    *, pairs: int, rounds: int, warmup: int, executable: str = "redis-server"
) -> dict[str, Any]:
    """Interleaved rounds of `pairs` acquire+release pairs: the single node is the very
    server the sentinels name as master (same process, same replicas), so the difference is
    what finding it through the sentinels costs per pair (nothing once connected)."""
    with LocalSentinel(executable=executable) as topology:
        master = topology.master()
        version = str(master.client().info("server")["redis_version"])
        single = RedisBackend(redis.Redis.from_url(master.url, **CLIENT_OPTIONS), prefix=PREFIX)
        sentinel = RedisSentinelBackend.from_url(topology.url, prefix=PREFIX)
        rows: list[Row] = [
            _jobfence_row(SINGLE, single, f"{PREFIX}:lock:*"),
            _jobfence_row(SENTINEL, sentinel, f"{PREFIX}:lock:*"),
        ]
        try:
            for row in rows:
                _time(row.pair, warmup)
            for r in range(rounds):
                for row in rows[r % 2 :] + rows[: r % 2]:
                    gc.collect()
                    wall, cpu = _time(row.pair, pairs)
                    row.seconds.append(wall)
                    row.cpu_seconds.append(cpu)
        finally:
            for row in rows:
                row.close()
    one, via = rows
    ratio = statistics.median(s / b for s, b in zip(via.seconds, one.seconds, strict=True))
    return {
        "redis_version": version,
        "pairs_per_round": pairs,
        "rounds": rounds,
        "rows": [
            {
                "name": row.name,
                "us_per_pair": round(statistics.median(row.seconds) / pairs * 1e6, 2),
                "cpu_us_per_pair": round(statistics.median(row.cpu_seconds) / pairs * 1e6, 2),
            }
            for row in rows
        ],
        "vs_single": round(ratio, 3),
    }


def format_rows(rep: dict[str, Any]) -> list[str]:
    out = [
        "",
        f"Sentinel: private redis-server {rep['redis_version']}, 1 master + 2 replicas + 3 "
        "sentinels; the single node is that same master reached directly;",
        f"median of {rep['rounds']} interleaved rounds x {rep['pairs_per_round']} pairs",
        "",
        f"  {'lock':<32} {'µs/pair':>8} {'cpu µs':>7}",
    ]
    for r in rep["rows"]:
        out.append(f"  {r['name']:<32} {r['us_per_pair']:>8.1f} {r['cpu_us_per_pair']:>7.1f}")
    out.append(f"  Sentinel / 1 node: {rep['vs_single']:.2f}x (the master is asked of the "
               "sentinels only when a connection is made)")  # fmt: skip
    return out
