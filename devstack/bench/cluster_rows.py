"""The lock benchmark's Cluster rows: pairs/s of several client processes, 3 masters vs one node."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from devstack.local_cluster import LocalCluster
from devstack.redis_server import RedisServer
from jobfence.locks import LockBackend, RedisBackend
from jobfence.locks.backends.redis.cluster import RedisClusterBackend

PREFIX = "clbench"
KEYS_PER_PROCESS = 64


class ClusterBenchError(RuntimeError):
    """A Cluster row could not run, or a lock refused a free key."""


def _open(kind: str, url: str) -> LockBackend:
    if kind == "cluster":
        return RedisClusterBackend.from_url(url, prefix=PREFIX)
    return RedisBackend.from_url(url, prefix=PREFIX)


def _client_main(kind: str, url: str, pairs: int, warmup: int, conn: Connection) -> None:
    """One client process: warm up, wait for the start, run `pairs` pairs on keys of its own."""
    try:
        backend = _open(kind, url)
        keys = [f"p{os.getpid()}:{i}" for i in range(KEYS_PER_PROCESS)]
        for i in range(warmup):
            lease = backend.try_acquire(keys[i % len(keys)], 10.0)
            if lease is None or not lease.release():
                raise ClusterBenchError("a free key was refused")
        conn.send("ready")
        conn.recv()  # go
        cpu0, t0 = time.process_time(), time.monotonic()
        for i in range(pairs):
            lease = backend.try_acquire(keys[i % len(keys)], 10.0)
            if lease is None or not lease.release():
                raise ClusterBenchError("a free key was refused")
        conn.send((t0, time.monotonic(), time.process_time() - cpu0))
        backend.close()
    except Exception as exc:  # reported by the parent
        conn.send(("error", repr(exc)))


def _server_cpu(servers: Sequence[RedisServer]) -> float:
    total = 0.0
    for server in servers:
        client = server.client(decode_responses=True)
        info: Any = client.info("cpu")
        total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


def _measure(
    kind: str, url: str, servers: Sequence[RedisServer], procs: int, pairs: int, warmup: int
) -> dict[str, float]:
    ctx = multiprocessing.get_context("fork")
    pipes, children = [], []
    for _ in range(procs):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_client_main, args=(kind, url, pairs, warmup, child))
        proc.start()
        pipes.append(parent)
        children.append(proc)
    try:
        for p in pipes:
            if p.recv() != "ready":
                raise ClusterBenchError("a client process failed to start")
        cpu_before = _server_cpu(servers)
        for p in pipes:
            p.send("go")
        results = [p.recv() for p in pipes]
        cpu_after = _server_cpu(servers)
    finally:
        for proc in children:
            proc.join(30)
    for r in results:
        if r[0] == "error":
            raise ClusterBenchError(f"a client process failed: {r[1]}")
    start, end = min(r[0] for r in results), max(r[1] for r in results)
    total = pairs * procs
    return {
        "pairs_per_s": total / (end - start),
        "client_cpu_us": sum(r[2] for r in results) / total * 1e6,
        "server_cpu_us": (cpu_after - cpu_before) / total * 1e6,
    }


def run(*, procs: Sequence[int] = (1, 4), pairs: int = 2000, rounds: int = 3,
        warmup: int = 100, executable: str = "redis-server") -> dict[str, Any]:  # fmt: skip
    """One private node and a private 3-master cluster, each client count measured in
    `rounds` interleaved rounds; the median round of each row is reported."""
    import statistics

    got: dict[tuple[str, int], list[dict[str, float]]] = {}
    with RedisServer(executable=executable) as single, LocalCluster(
        masters=3, executable=executable
    ) as cluster:
        configs = [("jobfence Redis, 1 node", "single", single.url, [single]),
                   ("jobfence Cluster, 3 masters", "cluster", cluster.url, cluster.masters)]
        for _ in range(rounds):
            for n in procs:
                for name, kind, url, servers in configs:
                    got.setdefault((name, n), []).append(
                        _measure(kind, url, servers, n, pairs, warmup)
                    )
    rows = []
    for (name, n), runs in got.items():
        runs.sort(key=lambda r: r["pairs_per_s"])
        middle = runs[len(runs) // 2]
        rows.append({"name": name, "procs": n, **middle,
                     "spread": statistics.pstdev(r["pairs_per_s"] for r in runs)})
    rows.sort(key=lambda r: (r["procs"], r["name"] != "jobfence Redis, 1 node"))
    return {"rows": rows, "pairs": pairs, "rounds": rounds, "cores": os.cpu_count() or 1}


def format_rows(rep: dict[str, Any]) -> list[str]:
    cores = rep["cores"]
    out = [
        "",
        f"Cluster rows ({rep['pairs']} pairs per client process, keys spread over the slots; "
        f"median of {rep['rounds']} interleaved rounds; {cores} cores; cpu ceiling: the cores "
        "divided by client + server CPU per pair):",
        "",
        f"{'lock pair':<30}{'clients':>8}{'pairs/s':>10}{'client cpu µs':>15}"
        f"{'server cpu µs':>15}{'cpu ceiling/s':>15}",
    ]
    for r in rep["rows"]:
        # What the box could do if every core ran only this: cores / CPU per pair.
        ceiling = cores / ((r["client_cpu_us"] + r["server_cpu_us"]) / 1e6)
        out.append(
            f"{r['name']:<30}{r['procs']:>8}{r['pairs_per_s']:>10.0f}"
            f"{r['client_cpu_us']:>15.1f}{r['server_cpu_us']:>15.1f}{ceiling:>15.0f}"
        )
    return out


def main() -> None:
    print("\n".join(format_rows(run())))


if __name__ == "__main__":
    main()
