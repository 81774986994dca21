"""The lock benchmark's Redlock rows: jobfence over 3 and 5 masters beside one node and pottery."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import multiprocessing
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import redis

from devstack.redis_masters import RedisMasters
from jobfence.locks import Lease, LockBackend, RedisBackend
from jobfence.locks.backends.redlock import RedlockBackend

PAIR_TTL = 10.0
PREFIX = "rlbench"
SINGLE = "jobfence Redis, 1 node"
REDLOCK_3 = "jobfence Redlock, 3 masters"
REDLOCK_5 = "jobfence Redlock, 5 masters"
REDLOCK_5_TWO = "jobfence Redlock, 5, 2 phases"
POTTERY_5 = "pottery Redlock, 5 masters"
FLOOR_1 = "floor: 2 PING rounds, 1 node"
FLOOR_5 = "floor: 2 PING rounds, 5 at once"
# redis-py options every contender's clients get (as locks_bench.CLIENT_OPTIONS).
CLIENT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 2.0,
    "socket_connect_timeout": 2.0,
    "decode_responses": True,
    "health_check_interval": 0,
}


class RedlockBenchError(RuntimeError):
    """A Redlock row could not run, or a lock refused a free key."""


@dataclass
class Row:
    name: str
    fence: bool
    pair: Callable[[], None]
    close: Callable[[], None]
    lock_pattern: str  # the lock keys this row leaves behind if it leaves any
    # Runs n pairs, returns (wall, CPU) seconds; None: `pair` in a loop in this process.
    timed: Callable[[int], tuple[float, float]] | None = None
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU per round
    pairs_run: int = 0
    orphans: int = 0
    refusals: list[int] = field(default_factory=lambda: [0])  # free key refused (pottery)


def _jobfence_row(name: str, backend: LockBackend, pattern: str) -> Row:
    def pair() -> None:
        lease = backend.try_acquire("pair", PAIR_TTL)
        if not isinstance(lease, Lease):
            raise RedlockBenchError(f"{name} refused a free key")
        if not lease.release():
            raise RedlockBenchError(f"{name}: release found another owner")

    return Row(name, True, pair, backend.close, pattern)


def _pottery_main(conn: Connection, urls: list[str]) -> None:
    """pottery in a process of its own: its executor threads outlive each call and slow
    down whatever else runs in their process (every row ran 2-3x slower beside them)."""
    from pottery import Redlock

    clients = [redis.Redis.from_url(u, **CLIENT_OPTIONS) for u in urls]
    lock = Redlock(key="pair", masters=set(clients), auto_release_time=PAIR_TTL)
    refusals = 0
    try:
        while (n := conn.recv()) is not None:
            cpu = time.process_time()
            started = time.perf_counter()
            for _ in range(n):
                # pottery returns once a majority answered, so the last masters may still
                # hold the previous pair's key: a refusal of the free key is counted.
                if lock.acquire(blocking=False):
                    lock.release()
                else:
                    refusals += 1
            conn.send((time.perf_counter() - started, time.process_time() - cpu, refusals))
    finally:
        for client in clients:
            client.close()


def _pottery_row(urls: list[str]) -> Row:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_pottery_main, args=(child, urls), name="bench-pottery")
    proc.start()
    child.close()
    refusals = [0]

    def timed(n: int) -> tuple[float, float]:
        try:
            parent.send(n)
            if not parent.poll(600):
                raise RedlockBenchError("pottery's process did not answer")
            wall, cpu, refusals[0] = parent.recv()
        except (OSError, EOFError) as exc:
            raise RedlockBenchError(f"pottery's process died: {exc!r}") from exc
        return float(wall), float(cpu)

    def close() -> None:
        with contextlib.suppress(OSError):
            parent.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        parent.close()

    def pair() -> None:
        timed(1)

    return Row(POTTERY_5, False, pair, close, "redlock:*", timed=timed, refusals=refusals)


def build_rows(masters: RedisMasters) -> list[Row]:
    """Every contender on the same private servers: the single node is master 0."""
    urls = [s.url for s in masters.servers]
    single = RedisBackend(redis.Redis.from_url(urls[0], **CLIENT_OPTIONS), prefix=f"{PREFIX}1")
    three = "redlock://" + ",".join(f"{s.host}:{s.port}" for s in masters.servers[:3])
    rows = [
        _jobfence_row(SINGLE, single, f"{PREFIX}1:lock:*"),
        _jobfence_row(REDLOCK_3, RedlockBackend.from_url(three, prefix=f"{PREFIX}3"),
                      f"{PREFIX}3:lock:*"),
        _jobfence_row(REDLOCK_5, RedlockBackend.from_url(masters.url, prefix=f"{PREFIX}5"),
                      f"{PREFIX}5:lock:*"),
        _jobfence_row(
            REDLOCK_5_TWO,
            RedlockBackend.from_url(masters.url, prefix=f"{PREFIX}5t", one_round=False),
            f"{PREFIX}5t:lock:*",
        ),
    ]  # fmt: skip
    if importlib.util.find_spec("pottery") is not None:  # the bench extra; else no row
        rows.append(_pottery_row(urls))
    rows.append(_floor_row(FLOOR_1, masters.servers[:1]))
    rows.append(_floor_row(FLOOR_5, masters.servers))
    return rows


def _time(pair: Callable[[], None], n: int) -> tuple[float, float]:
    cpu = time.process_time()
    started = time.perf_counter()
    for _ in range(n):
        pair()
    return time.perf_counter() - started, time.process_time() - cpu


def _run(row: Row, n: int) -> tuple[float, float]:
    return row.timed(n) if row.timed is not None else _time(row.pair, n)


def _floor_row(name: str, servers: list[Any]) -> Row:
    """Two rounds of PING sent to every server at once, every reply read: what a pair
    over these servers costs with no lock and no Python client in the way."""
    socks = []
    for server in servers:
        sock = socket.create_connection((server.host, server.port), timeout=2.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(sock)
    ping = b"*1\r\n$4\r\nPING\r\n"

    def one_round() -> None:
        for sock in socks:
            sock.sendall(ping)
        for sock in socks:
            if sock.recv(64) != b"+PONG\r\n":
                raise RedlockBenchError(f"{name}: unexpected reply")

    def pair() -> None:
        one_round()
        one_round()

    def close() -> None:
        for sock in socks:
            sock.close()

    return Row(name, False, pair, close, "no-such-key:*")


def run(
    *, pairs: int, rounds: int, warmup: int, executable: str = "redis-server"
) -> dict[str, Any]:
    """Interleaved rounds of `pairs` acquire+release pairs per row, then the lock keys each
    row left on the masters once its clients were closed (closing waits for replies still
    owed, so every command sent has run)."""
    with RedisMasters(5, executable=executable) as masters:
        admin = masters.client(0)
        version = str(admin.info("server")["redis_version"])
        admin.close()
        rows = build_rows(masters)
        try:
            for row in rows:
                _run(row, warmup)
                row.pairs_run += warmup
            for r in range(rounds):
                for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
                    gc.collect()
                    wall, cpu = _run(row, pairs)
                    row.seconds.append(wall)
                    row.cpu_seconds.append(cpu)
                    row.pairs_run += pairs
        finally:
            for row in rows:
                row.close()
        for row in rows:
            row.orphans = sum(len(names) for names in masters.keys(row.lock_pattern))
    return report(rows, pairs=pairs, rounds=rounds, version=version)


def report(rows: list[Row], *, pairs: int, rounds: int, version: str) -> dict[str, Any]:
    by = {row.name: row for row in rows}
    single = by[SINGLE]

    def ratio(row: Row, base: Row) -> float:
        # Per-round ratios (neighbours in time) resist a shared machine's drift.
        return statistics.median(s / b for s, b in zip(row.seconds, base.seconds, strict=True))

    out_rows = []
    for row in rows:
        med = statistics.median(row.seconds)
        out_rows.append({
            "name": row.name,
            "pairs_per_s": round(pairs / med, 1),
            "us_per_pair": round(med / pairs * 1e6, 2),
            "us_per_pair_min": round(min(row.seconds) / pairs * 1e6, 2),
            "us_per_pair_max": round(max(row.seconds) / pairs * 1e6, 2),
            "vs_single": round(ratio(row, single), 3),
            "cpu_us_per_pair": round(statistics.median(row.cpu_seconds) / pairs * 1e6, 2),
            "fence": row.fence,
            "pairs_run": row.pairs_run,
            "orphaned_lock_keys": row.orphans,
            "refused_free_key": row.refusals[0],
        })  # fmt: skip
    five = by[REDLOCK_5]
    targets = {
        "redlock5_at_most_1_5x_single": ratio(five, single) <= 1.5,
        "redlock_zero_orphans": all(
            r.orphans == 0 for r in rows if r.name.startswith("jobfence Redlock")
        ),
    }
    if POTTERY_5 in by:
        targets["redlock5_3x_faster_than_pottery5"] = ratio(by[POTTERY_5], five) >= 3.0
    return {
        "redis_version": version,
        "pairs_per_round": pairs,
        "rounds": rounds,
        "rows": out_rows,
        "targets": targets,
    }


def format_rows(rep: dict[str, Any]) -> list[str]:
    out = [
        "",
        f"Redlock: private redis-server {rep['redis_version']} x 5 (the single node is the "
        "first of them, 3 masters the first three), one client each, sequential loop,",
        f"median of {rep['rounds']} interleaved rounds x {rep['pairs_per_round']} pairs; "
        "orphans: lock keys left on any master after the run, clients closed",
        "",
        f"  {'lock':<32} {'pairs/s':>8} {'µs/pair':>8} {'(min-max)':>13} {'vs 1 node':>9} "
        f"{'cpu µs':>7} {'orphans':>7} {'refused':>7}  fence",
    ]
    for r in rep["rows"]:
        spread = f"({r['us_per_pair_min']:.0f}-{r['us_per_pair_max']:.0f})"
        out.append(
            f"  {r['name']:<32} {r['pairs_per_s']:>8.0f} {r['us_per_pair']:>8.1f} {spread:>13} "
            f"{r['vs_single']:>8.2f}x {r['cpu_us_per_pair']:>7.1f} {r['orphaned_lock_keys']:>7} "
            f"{r['refused_free_key']:>7}  "
            f"{'yes' if r['fence'] else 'no'}"
        )
    out += [
        "  vs 1 node: median over rounds of this row's round time / the single node's (<1 faster)",
        "  cpu µs: the client process's CPU per pair (the loopback's receiving side runs in it",
        "  too); pottery runs in a process of its own (its threads slow down their process)",
        "  floor: two rounds of PING to every server at once, raw sockets: what the servers and",
        "  the loopback alone cost; on 2 cores the 5 servers and the client share them, so the",
        "  5-master floor is several single-node floors, not one",
        "  refused: acquires of the free key that failed (the previous pair's release had not",
        "  reached every master yet); jobfence counts none: it would stop the run",
        "  jobfence Redlock, 5, 2 phases: the fence's second phase sent on every grant (the",
        "  default sends it only when a master refuses the client's proposal)",
    ]
    return out
