"""Lock benchmark: acquire+release pairs/s and release-to-waiter wake-up, jobfence beside peers.

Redis locks first (private redis-server), then PostgreSQL and MariaDB in the same run
(`devstack/bench/sql_rows.py`: a scratch database on each server, dropped at the end), then
etcd (`devstack/bench/etcd_rows.py`: a private etcd unless one is given), then
ZooKeeper (`devstack/bench/zookeeper_rows.py`: a private server unless one is given).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import multiprocessing
import platform
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import redis
import redis_lock
from redis.connection import AbstractConnection
from sqlalchemy.exc import SQLAlchemyError

from devstack import local_zookeeper
from devstack.bench import (
    charts,
    cluster_rows,
    etcd_rows,
    matrix,
    redlock_rows,
    sentinel_rows,
    sql_rows,
    zookeeper_rows,
)
from devstack.bench import report as report_io
from devstack.local_sentinel import SentinelError
from devstack.redis_server import RedisServer
from jobfence import locks
from jobfence.locks import Lease, RedisBackend

# The options RedisBackend.from_url gives its client; every contender gets a client built
# with exactly these, so the comparison is between lock algorithms, not client settings.
CLIENT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 2.0,
    "socket_connect_timeout": 2.0,
    "decode_responses": True,
    "health_check_interval": 0,
}
PREFIX = "bench"
PAIR_TTL = 10.0  # seconds; whole seconds because python-redis-lock takes an int
HOLD_TTL = 30.0  # a holder's lease in the wake-up test; never expires during a trial
WAIT_TIMEOUT = 10.0  # a waiter gives up after this long (an error in the report)
SETTLE_MIN = 0.005  # the waiter has been waiting at least this long before the release ...
SETTLE_SPAN = 0.100  # ... plus uniform(0, this): covers redis-py's 0.1 s poll phase evenly
RESULT_TTL = 60.0
SERVER_PROBE_PAIRS = 500  # pairs over which the server's CPU per pair is measured
FINGERPRINT = "bench-fingerprint"

RAW_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

REDIS_PY = "redis-py Lock"
JOBFENCE = "jobfence RedisBackend"


class BenchError(RuntimeError):
    """The benchmark could not run or a lock misbehaved (e.g. a grant that should not fail)."""


def now_ns() -> int:
    """CLOCK_MONOTONIC: one system-wide clock, comparable between the holder and the waiter."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def make_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, **CLIENT_OPTIONS)


# --------------------------------------------------------------------------- private server


class Server(Protocol):
    @property
    def url(self) -> str: ...

    def stop(self, timeout: float = 10.0) -> None: ...


def start_private_redis(executable: str = "redis-server") -> Server:
    """Start a private, non-persistent redis-server (devstack.redis_server) on a free port."""
    try:
        return RedisServer(executable=executable).start()
    except RuntimeError as exc:
        raise BenchError(str(exc)) from exc


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in (0, 100]."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def server_cpu(admin: redis.Redis) -> float:
    """CPU seconds the server's main thread has used (parsing, I/O, commands, Lua)."""
    cpu: dict[str, Any] = admin.info("cpu")
    if "used_cpu_user_main_thread" in cpu:
        return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def command_calls(admin: redis.Redis, command: str) -> int:
    """Calls of `command` the server has counted so far (including calls from Lua)."""
    stats: dict[str, dict[str, Any]] = admin.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


# --------------------------------------------------------------------------- pairs


@dataclass
class PairCase:
    name: str
    fence: bool
    pair: Callable[[], None]
    client: redis.Redis
    seconds: list[float] = field(default_factory=list)  # wall time of each round
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU in each round
    round_trips: float = 0.0
    server_us: float = 0.0  # server CPU per pair (INFO cpu, main thread)


def _raw_pair(client: redis.Redis) -> Callable[[], None]:
    release = client.register_script(RAW_RELEASE_LUA)
    key = f"{PREFIX}:raw"
    ttl_ms = int(PAIR_TTL * 1000)

    def pair() -> None:
        token = secrets.token_hex(16)
        if not client.set(key, token, nx=True, px=ttl_ms):
            raise BenchError("raw SET NX refused a free key")
        if not release(keys=[key], args=[token]):
            raise BenchError("raw release found another owner")

    return pair


def _redis_py_pair(client: redis.Redis) -> Callable[[], None]:
    key = f"{PREFIX}:redis-py"

    def pair() -> None:
        lock = client.lock(key, timeout=PAIR_TTL)
        if not lock.acquire(blocking=False):
            raise BenchError("redis-py Lock refused a free key")
        lock.release()

    return pair


def _redis_py_fenced_pair(client: redis.Redis) -> Callable[[], None]:
    """What a redis-py user would add for a fence: INCR a counter after the grant (3 RTTs)."""
    key, fence_key = f"{PREFIX}:redis-py-fenced", f"{PREFIX}:redis-py-fence"

    def pair() -> None:
        lock = client.lock(key, timeout=PAIR_TTL)
        if not lock.acquire(blocking=False):
            raise BenchError("redis-py Lock refused a free key")
        client.incr(fence_key)
        lock.release()

    return pair


def _python_redis_lock_pair(client: redis.Redis) -> Callable[[], None]:
    key = f"{PREFIX}:python-redis-lock"

    def pair() -> None:
        lock = redis_lock.Lock(client, key, expire=int(PAIR_TTL))
        if not lock.acquire(blocking=False):
            raise BenchError("python-redis-lock refused a free key")
        lock.release()

    return pair


def _jobfence_pair(backend: RedisBackend) -> Callable[[], None]:
    key = "pair"

    def pair() -> None:
        lease = backend.try_acquire(key, PAIR_TTL)
        if lease is None:
            raise BenchError("jobfence refused a free key")
        if not lease.release():
            raise BenchError("jobfence release found another owner")

    return pair


def _jobfence_job_pair(backend: RedisBackend) -> Callable[[], None]:
    counter = itertools.count()  # a DONE record blocks its key, so every job has its own

    def pair() -> None:
        key = f"job-{next(counter)}"
        got = backend.begin(key, PAIR_TTL, record=True, fingerprint=FINGERPRINT)
        if not isinstance(got, Lease):
            raise BenchError(f"jobfence begin refused a new job: {got!r}")
        ok = backend.commit(
            got, state="DONE", result='{"ok": true}', fingerprint=FINGERPRINT, result_ttl=RESULT_TTL
        )
        if not ok:
            raise BenchError("jobfence commit found another owner")

    return pair


def _time_pairs(pair: Callable[[], None], n: int) -> tuple[float, float]:
    """Run `n` pairs; return (wall seconds, client CPU seconds)."""
    cpu = time.process_time()
    started = time.perf_counter()
    for _ in range(n):
        pair()
    return time.perf_counter() - started, time.process_time() - cpu


def _count_round_trips(case: PairCase, n: int) -> float:
    """Commands sent per pair (none of the contenders pipelines, so one each is a round trip).

    Counted outside the timed rounds by wrapping redis-py's Connection.send_packed_command,
    which every command goes through, whichever client path a lock takes to its connection.
    """
    calls = 0
    original: Callable[..., Any] = AbstractConnection.send_packed_command

    def counting(self: AbstractConnection, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(self, *args, **kwargs)

    AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        _time_pairs(case.pair, n)
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]
    return calls / n


def run_pairs(url: str, *, pairs: int, rounds: int, warmup: int) -> list[PairCase]:
    """Sequential single-client loops; rounds interleave the locks so drift hits all alike."""
    clients = [make_client(url) for _ in range(6)]
    admin = make_client(url)
    try:
        backend = RedisBackend(clients[3], prefix=PREFIX)
        job_backend = RedisBackend(clients[4], prefix=PREFIX)
        cases = [
            PairCase("raw SET NX PX + Lua DEL", False, _raw_pair(clients[0]), clients[0]),
            PairCase(REDIS_PY, False, _redis_py_pair(clients[1]), clients[1]),
            PairCase("python-redis-lock", False, _python_redis_lock_pair(clients[2]), clients[2]),
            PairCase(JOBFENCE, True, _jobfence_pair(backend), clients[3]),
            PairCase(
                "jobfence begin+commit (job)", True, _jobfence_job_pair(job_backend), clients[4]
            ),
            PairCase(
                "redis-py Lock + INCR fence", True, _redis_py_fenced_pair(clients[5]), clients[5]
            ),
        ]
        for case in cases:
            _time_pairs(case.pair, warmup)
            before = server_cpu(admin)
            _time_pairs(case.pair, SERVER_PROBE_PAIRS)
            case.server_us = (server_cpu(admin) - before) / SERVER_PROBE_PAIRS * 1e6
            case.round_trips = _count_round_trips(case, 20)
        for r in range(rounds):
            for case in cases[r % len(cases) :] + cases[: r % len(cases)]:
                gc.collect()
                wall, cpu = _time_pairs(case.pair, pairs)
                case.seconds.append(wall)
                case.cpu_seconds.append(cpu)
        return cases
    finally:
        for c in [*clients, admin]:
            c.close()


# --------------------------------------------------------------------------- wake-up


def _waiter_main(conn: Connection, url: str) -> None:
    """The waiter process: for each (lib, key) block until acquired, stamp the time, release."""
    client = make_client(url)
    backend = RedisBackend(client, prefix=PREFIX)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            lib, key = msg
            try:
                stamp = _wait_and_acquire(lib, key, client, backend)
            except Exception as exc:
                conn.send((key, "error", f"{type(exc).__name__}: {exc}"))
            else:
                conn.send((key, "ok", stamp))
    finally:
        client.close()


def _wait_and_acquire(lib: str, key: str, client: redis.Redis, backend: RedisBackend) -> int:
    if lib == JOBFENCE:
        lease = locks.acquire(backend, key, ttl=HOLD_TTL, timeout=WAIT_TIMEOUT)
        stamp = now_ns()
        lease.release()
    elif lib == REDIS_PY:
        lock = client.lock(key, timeout=HOLD_TTL, blocking_timeout=WAIT_TIMEOUT)
        got = lock.acquire(blocking=True)  # redis-py's default poll: sleep=0.1
        stamp = now_ns()
        if not got:
            raise BenchError(f"redis-py Lock not acquired within {WAIT_TIMEOUT}s")
        lock.release()
    else:
        plock = redis_lock.Lock(client, key, expire=int(HOLD_TTL))
        got = plock.acquire(blocking=True, timeout=int(WAIT_TIMEOUT))  # BLPOP on its signal
        stamp = now_ns()
        if not got:
            raise BenchError(f"python-redis-lock not acquired within {WAIT_TIMEOUT}s")
        plock.release()
    return stamp


@dataclass
class WakeCase:
    name: str
    hold: Callable[[str], Callable[[], object]]  # acquire `key`, return its release
    attempt_command: str  # the command of the waiter's acquire attempt
    blocks_on_server: bool  # waits in BLPOP (else sleeps client-side between polls)
    delays_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    not_seen_blocked: int = 0


def _wake_cases(client: redis.Redis, backend: RedisBackend) -> list[WakeCase]:
    def hold_jobfence(key: str) -> Callable[[], object]:
        lease = backend.try_acquire(key, HOLD_TTL)
        if lease is None:
            raise BenchError(f"holder could not take {key}")
        return lease.release

    def hold_redis_py(key: str) -> Callable[[], object]:
        lock = client.lock(key, timeout=HOLD_TTL)
        if not lock.acquire(blocking=False):
            raise BenchError(f"holder could not take {key}")
        release: Callable[[], object] = lock.release
        return release

    def hold_prl(key: str) -> Callable[[], object]:
        plock = redis_lock.Lock(client, key, expire=int(HOLD_TTL))
        if not plock.acquire(blocking=False):
            raise BenchError(f"holder could not take {key}")
        release: Callable[[], object] = plock.release
        return release

    return [
        WakeCase(JOBFENCE, hold_jobfence, "evalsha", True),
        WakeCase(REDIS_PY, hold_redis_py, "set", False),
        WakeCase("python-redis-lock", hold_prl, "set", True),
    ]


def _blocked_in_blpop(admin: redis.Redis) -> bool:
    return any(c.get("cmd") == "blpop" and "b" in c.get("flags", "") for c in admin.client_list())


def _wake_trial(
    case: WakeCase, key: str, conn: Connection, admin: redis.Redis, rng: random.Random
) -> float:
    """One trial: hold `key`, let the waiter block on it, release, return the delay in ms."""
    release = case.hold(key)
    released = False
    try:
        attempts = command_calls(admin, case.attempt_command)
        conn.send((case.name, key))
        deadline = time.monotonic() + 5.0
        while command_calls(admin, case.attempt_command) <= attempts:  # first failed attempt
            if time.monotonic() > deadline:
                raise BenchError(f"{case.name}: the waiter made no attempt within 5 s")
            time.sleep(0.0005)
        if case.blocks_on_server:
            deadline = time.monotonic() + 1.0
            while not _blocked_in_blpop(admin):
                if time.monotonic() > deadline:
                    case.not_seen_blocked += 1
                    break
                time.sleep(0.0005)
        time.sleep(SETTLE_MIN + rng.random() * SETTLE_SPAN)
        released_at = now_ns()
        released = True
        release()
    finally:
        if not released:  # an error before the timed release: free the waiter
            release()
    deadline = time.monotonic() + WAIT_TIMEOUT + 5.0
    while True:  # replies to earlier, failed trials may still be queued: skip them
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise BenchError(f"{case.name}: the waiter did not answer")
        reply_key, status, value = conn.recv()
        if reply_key == key:
            break
    if status != "ok":
        raise BenchError(f"{case.name}: waiter failed: {value}")
    if value < released_at:
        raise BenchError(f"{case.name}: the waiter acquired before the release")
    return float((value - released_at) / 1e6)


def run_wakeup(
    url: str, *, trials: int, warmup: int = 3, seed: int | None = None
) -> list[WakeCase]:
    """Holder here, one blocked waiter in another process; time from release to acquisition."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_waiter_main, args=(child, url), name="bench-waiter", daemon=True)
    proc.start()
    child.close()
    client, admin = make_client(url), make_client(url)
    rng = random.Random(seed)
    try:
        cases = _wake_cases(client, RedisBackend(client, prefix=PREFIX))
        for case in cases:
            slug = case.name.split()[0]
            for i in range(warmup):
                _wake_trial(case, f"wake-{slug}-warm-{i}", parent, admin, rng)
            case.not_seen_blocked = 0
        # Interleave the libraries trial by trial, so slow drift affects all alike.
        for i in range(trials):
            for case in cases:
                slug = case.name.split()[0]
                try:
                    case.delays_ms.append(_wake_trial(case, f"wake-{slug}-{i}", parent, admin, rng))
                except BenchError as exc:
                    case.errors.append(str(exc))
                    if not proc.is_alive():
                        raise
        return cases
    finally:
        with contextlib.suppress(OSError, ValueError):
            parent.send(None)
        proc.join(5.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        parent.close()
        client.close()
        admin.close()


# --------------------------------------------------------------------------- report


def build_report(
    url: str,
    server_version: str,
    cases: list[PairCase],
    wakes: list[WakeCase],
    *,
    pairs: int,
    rounds: int,
    warmup: int,
    trials: int,
) -> dict[str, Any]:
    base = next(c for c in cases if c.name == REDIS_PY)

    def speed_vs_base(c: PairCase) -> float:
        # Per-round ratios (same round, neighbouring in time) resist load drift better
        # than a ratio of medians on a shared machine.
        return statistics.median(b / s for b, s in zip(base.seconds, c.seconds, strict=True))

    rows = []
    for c in cases:
        med = statistics.median(c.seconds)
        rows.append(
            {
                "name": c.name,
                "pairs_per_s": round(pairs / med, 1),
                "us_per_pair": round(med / pairs * 1e6, 2),
                "us_per_pair_min": round(min(c.seconds) / pairs * 1e6, 2),
                "us_per_pair_max": round(max(c.seconds) / pairs * 1e6, 2),
                "cpu_us_per_pair": round(statistics.median(c.cpu_seconds) / pairs * 1e6, 2),
                "speed_vs_redis_py": round(speed_vs_base(c), 3),
                "round_trips_per_pair": round(c.round_trips, 2),
                "server_us_per_pair": round(c.server_us, 2),
                "fence": c.fence,
            }
        )
    wake_rows = []
    for w in wakes:
        d = w.delays_ms
        wake_rows.append(
            {
                "name": w.name,
                "n": len(d),
                "median_ms": round(statistics.median(d), 3) if d else None,
                "p95_ms": round(percentile(d, 95), 3) if d else None,
                "min_ms": round(min(d), 3) if d else None,
                "max_ms": round(max(d), 3) if d else None,
                "errors": w.errors,
                "not_seen_blocked": w.not_seen_blocked,
            }
        )
    jf_speed = speed_vs_base(next(c for c in cases if c.name == JOBFENCE))
    jf_wake = next(w for w in wakes if w.name == JOBFENCE).delays_ms
    return {
        "server": {"url": url, "redis_version": server_version},
        "python": platform.python_version(),
        "versions": {
            "redis-py": redis.__version__,
            "python-redis-lock": getattr(redis_lock, "__version__", "?"),
        },
        "config": {
            "pairs_per_round": pairs,
            "rounds": rounds,
            "warmup_pairs": warmup,
            "wakeup_trials": trials,
            "client_options": CLIENT_OPTIONS,
            "settle_ms": [SETTLE_MIN * 1000, (SETTLE_MIN + SETTLE_SPAN) * 1000],
        },
        "pairs": rows,
        "wakeup": wake_rows,
        "targets": {
            "pair_no_slower_than_redis_py": jf_speed >= 1.0,
            "wakeup_median_under_5ms": bool(jf_wake) and statistics.median(jf_wake) < 5.0,
        },
    }


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    out = [
        "jobfence lock benchmark",
        f"  server  private redis-server {report['server']['redis_version']} at "
        f"{report['server']['url']}",
        f"  python  {report['python']}, redis-py {report['versions']['redis-py']}, "
        f"python-redis-lock {report['versions']['python-redis-lock']}",
        "",
        f"acquire+release pairs: one client each (same options), sequential loop, "
        f"{cfg['warmup_pairs']} warm-up pairs,",
        f"median of {cfg['rounds']} interleaved rounds x {cfg['pairs_per_round']} pairs",
        "",
        f"  {'lock':<28} {'pairs/s':>8} {'µs/pair':>8} {'(min-max)':>13} "
        f"{'vs redis-py':>11} {'cpu µs':>7} {'srv µs':>7} {'RTTs':>4}  fence",
    ]
    for r in report["pairs"]:
        spread = f"({r['us_per_pair_min']:.0f}-{r['us_per_pair_max']:.0f})"
        out.append(
            f"  {r['name']:<28} {r['pairs_per_s']:>8.0f} {r['us_per_pair']:>8.1f} {spread:>13} "
            f"{r['speed_vs_redis_py']:>10.2f}x {r['cpu_us_per_pair']:>7.1f} "
            f"{r['server_us_per_pair']:>7.1f} {r['round_trips_per_pair']:>4.0f}  "
            f"{'yes' if r['fence'] else 'no'}"
        )
    out += [
        "  vs redis-py: median over rounds of redis-py's round time / this lock's (>1 faster)",
        "  cpu µs: this process's CPU per pair; srv µs: redis-server main-thread CPU per pair",
        f"  (INFO cpu, over {SERVER_PROBE_PAIRS} pairs); RTTs: round trips per pair",
        "  redis-py Lock + INCR fence: context only; its counter restarts if Redis loses its data",
        "  jobfence sends its scripts on connections its backend keeps out of redis-py's pool;",
        "  the others check one out of the pool per command (redis-py's default path)",
        "",
        f"wake-up: holder here, one waiter in another process already blocked "
        f"(first failed attempt seen, then {cfg['settle_ms'][0]:.0f}-"
        f"{cfg['settle_ms'][1]:.0f} ms), delay from just before release to the "
        f"waiter's acquire returning, {cfg['wakeup_trials']} trials",
        "",
        f"  {'lock':<30} {'median ms':>10} {'p95 ms':>9} {'min ms':>9} {'max ms':>9} {'n':>5}",
    ]
    for w in report["wakeup"]:
        if w["n"]:
            out.append(
                f"  {w['name']:<30} {w['median_ms']:>10.3f} {w['p95_ms']:>9.3f} "
                f"{w['min_ms']:>9.3f} {w['max_ms']:>9.3f} {w['n']:>5}"
            )
        else:
            out.append(f"  {w['name']:<30} {'no successful trial':>10}")
        if w["errors"]:
            out.append(f"    {len(w['errors'])} error(s), first: {w['errors'][0]}")
        if w["not_seen_blocked"]:
            out.append(f"    {w['not_seen_blocked']} trial(s) never caught the waiter in BLPOP")
    pairs_by = {r["name"]: r for r in report["pairs"]}
    jf, rp = pairs_by[JOBFENCE], pairs_by[REDIS_PY]
    jf_wake = next(w for w in report["wakeup"] if w["name"] == JOBFENCE)
    t = report["targets"]
    if "sql" in report:
        sql = report["sql"]
        for label, version in sql["servers"].items():
            out.append(f"  {label} server: {version}")
        out += sql_rows.format_rows(sql["rows"], sql["skipped"], jf, jf_wake)
    if "etcd" in report:
        out += etcd_rows.format_rows(report["etcd"])
    if "redlock" in report:
        out += redlock_rows.format_rows(report["redlock"])
    if "cluster" in report:
        out += cluster_rows.format_rows(report["cluster"])
    if "sentinel" in report:
        out += sentinel_rows.format_rows(report["sentinel"])
    if "zookeeper" in report:
        out += zookeeper_rows.format_rows(report["zookeeper"])
    out += [
        "",
        "targets",
        f"  per pair no slower than redis-py Lock, with a fence: "
        f"{jf['us_per_pair']:.1f} vs {rp['us_per_pair']:.1f} µs  "
        f"{'MET' if t['pair_no_slower_than_redis_py'] else 'MISSED'}",
        f"  waiter wake-up median under 5 ms: {jf_wake['median_ms']} ms  "
        f"{'MET' if t['wakeup_median_under_5ms'] else 'MISSED'}",
    ]
    for name, met in t.items():
        if name.startswith(("postgres_", "mariadb_", "etcd_", "redlock", "zookeeper_")):
            out.append(f"  {name.replace('_', ' ')}: {'MET' if met else 'MISSED'}")
    return "\n".join(out)


# --------------------------------------------------------------------------- SQL rows


def run_sql(args: argparse.Namespace) -> dict[str, Any]:
    """The PostgreSQL and MariaDB rows, each on a scratch database; skipped with a reason."""
    skipped: dict[str, str] = {}
    servers = {"PostgreSQL": args.postgres, "MariaDB": args.mariadb}
    with sql_rows.scratch_databases(servers, skipped) as dbs:
        rows = sql_rows.plan(dbs, skipped)
        if not args.quiet:
            names = ", ".join(r.name for r in rows) or "none"
            print(f"running SQL rows: {names} ...", flush=True)
        if rows:
            sql_pairs = args.sql_pairs
            sql_rows.run_pairs(rows, pairs=sql_pairs, rounds=args.rounds, warmup=args.warmup // 5)
            sql_rows.run_wakeup(rows, trials=args.waiters, seed=args.seed)
        versions = {db.label: db.version for db in dbs}
    reported = sql_rows.report_rows(rows, pairs=args.sql_pairs)
    return {
        "servers": versions,
        "pairs_per_round": args.sql_pairs,
        "rows": reported,
        "skipped": skipped,
        "anchor": sql_rows.ANCHOR,
        "targets": sql_rows.targets(reported),
    }


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobfence bench locks",
        description="Every lock backend in one run (pair latency, wake-up delay, pairs/s with "
        "1 and N client processes), written as JSON and a PNG chart; --detail adds the "
        "single-process tables beside the peers (round trips, server CPU, targets).",
    )
    p.add_argument(
        "--only",
        default=",".join(matrix.GROUPS),
        metavar="LIST",
        help=f"comma-separated backends to measure (default all: {','.join(matrix.GROUPS)})",
    )
    p.add_argument("--quick", action="store_true",
                   help="a small run (1 round of 0.3 s, 2 clients, 3 wake-ups)")  # fmt: skip
    p.add_argument("--clients", type=int, default=None,
                   help="client processes of the many-client runs (default 8)")  # fmt: skip
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds of each throughput run (default 2)")  # fmt: skip
    p.add_argument("--matrix-rounds", type=int, default=None,
                   help="interleaved throughput rounds per backend (default 3)")  # fmt: skip
    p.add_argument("--wake-trials", type=int, default=None,
                   help="wake-up trials per backend (default 30)")  # fmt: skip
    p.add_argument("--no-contended", action="store_true",
                   help="skip the N-clients-on-one-key runs")  # fmt: skip
    p.add_argument("--detail", action="store_true",
                   help="also run the single-process detail tables (the old report)")  # fmt: skip
    p.add_argument("--markdown-from", default=None, metavar="JSON",
                   help="print the README's Markdown table from a report written earlier; "
                   "runs nothing")  # fmt: skip
    p.add_argument("--readme", default=None, metavar="PATH",
                   help="with --markdown-from: replace the table between the bench-locks "
                   "markers of PATH (docs/benchmarks.md) instead of printing it")  # fmt: skip
    p.add_argument("--pairs", type=int, default=1000, help="pairs per round (default 1000)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per lock (default 15)")
    p.add_argument("--warmup", type=int, default=500, help="warm-up pairs per lock (default 500)")
    p.add_argument("--waiters", type=int, default=100, help="wake-up trials per lock (default 100)")
    report_io.add_output_args(p)
    p.add_argument(
        "--check", action="store_true", help="exit 1 if a target is missed (implies --detail)"
    )
    p.add_argument("--seed", type=int, default=None, help="seed for the settle delays")
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    p.add_argument(
        "--postgres",
        default=sql_rows.DEFAULT_POSTGRES,
        metavar="URL",
        help="PostgreSQL server (a scratch database is created and dropped there); '' skips",
    )
    p.add_argument(
        "--mariadb",
        default=sql_rows.DEFAULT_MARIADB,
        metavar="URL",
        help="MariaDB/MySQL server (a scratch database is created and dropped there); '' skips",
    )
    p.add_argument(
        "--sql-pairs", type=int, default=200, help="pairs per round on SQL rows (default 200)"
    )
    p.add_argument(
        "--etcd",
        default=None,
        metavar="URL",
        help="etcd to measure (etcd://host:port); default: a private etcd started for the "
        "run; '' skips",
    )
    p.add_argument(
        "--redlock-pairs",
        type=int,
        default=500,
        help="pairs per round on the Redlock rows, over 5 private masters (default 500; 0 skips)",
    )
    p.add_argument(
        "--cluster-pairs",
        type=int,
        default=2000,
        help="pairs per client process on the Cluster rows, 1 node vs a private 3-master "
        "cluster with 1 and 4 client processes (default 2000; 0 skips)",
    )
    p.add_argument(
        "--sentinel-pairs",
        type=int,
        default=500,
        help="pairs per round on the Sentinel row, over a private master, 2 replicas and 3 "
        "sentinels (default 500; 0 skips)",
    )
    p.add_argument(
        "--zookeeper",
        default=zookeeper_rows.AUTO,
        metavar="URL",
        help="ZooKeeper server (zookeeper://host:port, a chroot of the run's own is used); "
        "'auto' (default) starts a private one; '' skips",
    )
    args = p.parse_args(argv)
    for name in ("pairs", "rounds", "waiters", "sql_pairs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.redlock_pairs < 0:
        p.error("--redlock-pairs must be >= 0")
    if args.cluster_pairs < 0:
        p.error("--cluster-pairs must be >= 0")
    if args.sentinel_pairs < 0:
        p.error("--sentinel-pairs must be >= 0")
    args.groups = [g.strip() for g in args.only.split(",") if g.strip()]
    bad = [g for g in args.groups if g not in matrix.GROUPS]
    if bad:
        known = ",".join(matrix.GROUPS)
        p.error(f"--only: unknown backend(s) {', '.join(bad)}; choose from {known}")
    for name in ("clients", "matrix_rounds", "wake_trials"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.seconds is not None and args.seconds <= 0:
        p.error("--seconds must be > 0")
    args.quiet = report_io.json_to_stdout(args)
    args.detail = args.detail or args.check
    return args


def settings(args: argparse.Namespace) -> matrix.Settings:
    """The every-backend run's settings: --quick's small defaults, then what was given."""
    base = (
        matrix.Settings(clients=2, seconds=0.3, rounds=1, warmup=10, wake_trials=3)
        if args.quick
        else matrix.Settings()
    )
    return matrix.Settings(
        clients=args.clients or base.clients,
        seconds=args.seconds or base.seconds,
        rounds=args.matrix_rounds or base.rounds,
        warmup=base.warmup,
        wake_trials=args.wake_trials or base.wake_trials,
        contended=not args.no_contended,
        seed=args.seed,
    )


def run_detail(args: argparse.Namespace) -> dict[str, Any]:
    """The single-process detail tables beside the peers (the report before the matrix)."""
    server = start_private_redis(args.redis_server)
    try:
        admin = make_client(server.url)
        try:
            version = str(admin.info("server")["redis_version"])
        finally:
            admin.close()
        if not args.quiet:
            print(f"running on private redis-server {version} at {server.url} ...", flush=True)
        cases = run_pairs(server.url, pairs=args.pairs, rounds=args.rounds, warmup=args.warmup)
        wakes = run_wakeup(server.url, trials=args.waiters, seed=args.seed)
        report = build_report(
            server.url,
            version,
            cases,
            wakes,
            pairs=args.pairs,
            rounds=args.rounds,
            warmup=args.warmup,
            trials=args.waiters,
        )
        report["sql"] = run_sql(args)
        report["targets"].update(report["sql"]["targets"])
        if not args.quiet:
            print("running the etcd row ...", flush=True)
        report["etcd"] = etcd_rows.run(
            args.etcd, pairs=args.sql_pairs, rounds=args.rounds, warmup=args.warmup // 5,
            trials=args.waiters, seed=args.seed,
        )  # fmt: skip
        report["targets"].update(report["etcd"].get("targets", {}))
        if args.redlock_pairs:
            if not args.quiet:
                print("running Redlock rows on 5 private masters ...", flush=True)
            report["redlock"] = redlock_rows.run(
                pairs=args.redlock_pairs,
                rounds=args.rounds,
                warmup=args.warmup // 5,
                executable=args.redis_server,
            )
            report["targets"].update(report["redlock"]["targets"])
        if args.cluster_pairs:
            if not args.quiet:
                print("running Cluster rows on a private 3-master cluster ...", flush=True)
            report["cluster"] = cluster_rows.run(
                pairs=args.cluster_pairs, rounds=3, executable=args.redis_server
            )
        if args.sentinel_pairs:
            if not args.quiet:
                print("running the Sentinel row ...", flush=True)
            report["sentinel"] = sentinel_rows.run(
                pairs=args.sentinel_pairs,
                rounds=args.rounds,
                warmup=args.warmup // 5,
                executable=args.redis_server,
            )
        report["zookeeper"] = zookeeper_rows.run(
            args.zookeeper, pairs=args.sql_pairs, rounds=args.rounds, warmup=args.warmup // 5,
            trials=args.waiters, seed=args.seed, quiet=args.quiet,
        )  # fmt: skip
        report["targets"].update(report["zookeeper"]["targets"])
    finally:
        server.stop()
    return report


DETAIL_ERRORS = (
    BenchError,
    sql_rows.SqlBenchError,
    SQLAlchemyError,
    local_zookeeper.ZooKeeperError,
    redis.RedisError,
    locks.LockError,
    redlock_rows.RedlockBenchError,
    cluster_rows.ClusterBenchError,
    SentinelError,
)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if --check and a target is missed, 2 on failure."""
    args = parse_args(argv)
    if args.markdown_from:
        try:
            document = report_io.load(args.markdown_from)
            table = matrix.markdown(document["results"]["backends"], document["machine"])
            if args.readme:
                readme = Path(args.readme)
                readme.write_text(matrix.into_readme(readme.read_text("utf-8"), table), "utf-8")
            else:
                print(table)
        except (OSError, ValueError, KeyError) as exc:
            print(f"bench: cannot read {args.markdown_from}: {exc}", file=sys.stderr)
            return 2
        return 0
    started = time.monotonic()
    results: dict[str, Any] = {}
    try:
        results["backends"] = matrix.run(
            args.groups, settings(args), redis_server=args.redis_server,
            postgres=args.postgres, mariadb=args.mariadb, etcd=args.etcd,
            zookeeper=args.zookeeper, quiet=args.quiet,
        )  # fmt: skip
        if args.detail:
            results["detail"] = run_detail(args)
    except (matrix.MatrixError, *DETAIL_ERRORS) as exc:
        print(f"bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    results["seconds"] = round(time.monotonic() - started, 1)
    if args.quiet:
        print(json.dumps(results))
    else:
        text = matrix.format_rows(results["backends"])
        if "detail" in results:
            text += ["", format_report(results["detail"])]
        print("\n".join(["", "jobfence lock benchmark", *text]))
    report_io.write_report("locks", results, png=charts.locks_chart, args=args)
    detail = results.get("detail")
    if args.check and detail is not None and not all(detail["targets"].values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
