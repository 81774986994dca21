"""Every lock backend measured the same way in one run: pair latency, wake-up, pairs/s at 1 and N.

Each contender (a jobfence backend, a SQL advisory lock, or a peer lock library) runs only in
client processes of its own, forked from a clean forkserver, each with its own connection:

- pairs/s with 1 and with N client processes, each on keys of its own, for a fixed time
  (the 1-client run also times every pair: the pair latency and its spread);
- pairs/s with N client processes all on one key (blocking acquire, then release);
- wake-up: a holder process and a waiter process already blocked on the key; the delay from
  just before the holder's release to the waiter's acquire returning (CLOCK_MONOTONIC);
- on Redis and PostgreSQL, an asyncio row (devstack/bench/async_rows.py): AsyncLocker's
  pair latency and pairs/s of one loop of 100 coroutines.

Servers are private (redis-server, 5 Redlock masters, Sentinel, Cluster, etcd, ZooKeeper)
or, for PostgreSQL and MariaDB, a scratch database on the machine's servers; a contender
whose server or library is missing is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import multiprocessing
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

GROUPS = (
    "memory",
    "redis",
    "redis-py",
    "python-redis-lock",
    "redlock",
    "pottery",
    "sentinel",
    "cluster",
    "postgres",
    "mariadb",
    "etcd",
    "zookeeper",
)
PAIR_TTL = 10.0
HOLD_TTL = 30.0
WAIT_TIMEOUT = 10.0
SETTLE_MIN = 0.005  # the waiter has said it is about to block at least this long before ...
SETTLE_SPAN = 0.100  # ... plus uniform(0, this): covers a poller's 0.1 s phase evenly
KEYS_PER_CLIENT = 64
PREFIX = "mxbench"
CLIENT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 2.0,
    "socket_connect_timeout": 2.0,
    "decode_responses": True,
    "health_check_interval": 0,
}
# What each group's client processes import, loaded once into the forkserver.
PRELOAD = {
    "memory": ["jobfence.locks.backends.memory"],
    "redis": ["jobfence.locks.backends.redis", "jobfence.locks.backends.redis.async_store"],
    "redis-py": ["redis"],
    "python-redis-lock": ["redis_lock"],
    "redlock": ["jobfence.locks.backends.redlock"],
    "pottery": ["pottery"],
    "sentinel": ["jobfence.locks.backends.redis.sentinel"],
    "cluster": ["jobfence.locks.backends.redis.cluster"],
    "postgres": [
        "jobfence.locks.backends.postgres",
        "jobfence.locks.backends.postgres.async_store",
        "jobfence.locks.advisory",
    ],
    "mariadb": ["jobfence.locks.backends.mysql", "jobfence.locks.advisory"],
    "etcd": ["jobfence.locks.backends.etcd"],
    "zookeeper": ["jobfence.locks.backends.zookeeper"],
}


class MatrixError(RuntimeError):
    """A contender could not run, or a lock misbehaved (a free key refused, a lost release)."""


def now_ns() -> int:
    """CLOCK_MONOTONIC: one system-wide clock, comparable between processes."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass(frozen=True)
class Contender:
    """One lock to measure; picklable, opened anew in every client process."""

    name: str
    group: str  # one of GROUPS (what --only selects)
    kind: str  # "jobfence", "advisory", "redis-py", "python-redis-lock", "pottery"
    url: str  # a lock URL, or for peers the server URL(s), comma-separated
    fence: bool
    cross_process: bool = True  # False: the memory backend (each process has its own)
    note: str = ""


@dataclass(frozen=True)
class Settings:
    clients: int = 8
    seconds: float = 2.0  # each throughput run
    rounds: int = 3  # throughput runs per contender and client count, interleaved
    warmup: int = 100  # pairs per client before the timed run
    wake_trials: int = 30
    contended: bool = True
    seed: int | None = None


# --------------------------------------------------------------------------- the locks


class Lock(Protocol):
    def pair(self, key: str) -> bool: ...  # acquire a free key and release; False: refused

    def hold(self, key: str) -> Callable[[], None]: ...  # take `key` now, return its release

    def wait(self, key: str, timeout: float) -> Callable[[], None]: ...  # block until granted

    def close(self) -> None: ...


class JobfenceLock:
    def __init__(self, url: str) -> None:
        from jobfence import locks

        self._locks = locks
        self.backend = (
            locks.open_backend(url)
            if url.startswith("memory")
            else locks.open_backend(url, prefix=PREFIX)
        )

    def pair(self, key: str) -> bool:
        lease = self.backend.try_acquire(key, PAIR_TTL)
        if lease is None:
            return False
        if not lease.release():
            raise MatrixError("release found another owner")
        return True

    def hold(self, key: str) -> Callable[[], None]:
        lease = self.backend.try_acquire(key, HOLD_TTL)
        if lease is None:
            raise MatrixError(f"the holder could not take {key}")
        return lambda: None if lease.release() else _lost()

    def wait(self, key: str, timeout: float) -> Callable[[], None]:
        lease = self._locks.acquire(self.backend, key, ttl=HOLD_TTL, timeout=timeout)
        return lambda: None if lease.release() else _lost()

    def close(self) -> None:
        self.backend.close()


def _lost() -> None:
    raise MatrixError("release found another owner")


class AdvisoryLock:
    """A transaction-scoped advisory lock (PostgreSQL) or GET_LOCK (MariaDB) with its fence."""

    def __init__(self, url: str) -> None:
        import sqlalchemy as sa

        from jobfence.locks import advisory
        from jobfence.locks.guards import fences
        from jobfence.locks.sql import ensure_tables

        self._advisory = advisory
        self.engine = sa.create_engine(url, pool_size=1, max_overflow=0)
        ensure_tables(self.engine, [fences])

    def pair(self, key: str) -> bool:
        with self.engine.begin() as conn, self._advisory.try_transaction_lock(conn, key) as fence:
            return fence is not None

    def _open(self, key: str, timeout: float | None) -> Callable[[], None]:
        conn = self.engine.connect()
        tx = conn.begin()
        try:
            if timeout is None:
                with self._advisory.try_transaction_lock(conn, key) as fence:
                    if fence is None:
                        raise MatrixError(f"the holder could not take {key}")
            else:
                with self._advisory.transaction_lock(conn, key, timeout=timeout):
                    pass
        except BaseException:
            tx.rollback()
            conn.close()
            raise

        def commit() -> None:  # the release: PostgreSQL at commit, GET_LOCK right after
            tx.commit()
            conn.close()

        return commit

    def hold(self, key: str) -> Callable[[], None]:
        return self._open(key, None)

    def wait(self, key: str, timeout: float) -> Callable[[], None]:
        return self._open(key, timeout)

    def close(self) -> None:
        self.engine.dispose()


class PeerLock:
    """A peer library's lock object per call: pair, hold and wait written once; each peer
    says how it builds a lock (`_lock`) and how a blocking acquire takes its timeout."""

    def _lock(self, key: str, ttl: float) -> Any:
        raise NotImplementedError

    def _acquire_waiting(self, lock: Any, timeout: float) -> bool:
        return bool(lock.acquire(blocking=True, timeout=timeout))

    def pair(self, key: str) -> bool:
        # A refusal of a free key is counted, not raised: pottery returns once a majority
        # answered, so a late master may still hold the previous pair's key.
        lock = self._lock(key, PAIR_TTL)
        if not lock.acquire(blocking=False):
            return False
        lock.release()
        return True

    def hold(self, key: str) -> Callable[[], None]:
        lock = self._lock(key, HOLD_TTL)
        if not lock.acquire(blocking=False):
            raise MatrixError(f"the holder could not take {key}")
        release: Callable[[], None] = lock.release
        return release

    def wait(self, key: str, timeout: float) -> Callable[[], None]:
        lock = self._lock(key, HOLD_TTL)
        if not self._acquire_waiting(lock, timeout):
            raise MatrixError(f"not granted within {timeout:.0f} s")
        release: Callable[[], None] = lock.release
        return release


class RedisPyLock(PeerLock):
    """redis-py's Lock: SET NX PX, a Lua release; a waiter polls every 0.1 s (its default)."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, **CLIENT_OPTIONS)

    def _lock(self, key: str, ttl: float) -> Any:
        return self.client.lock(f"{PREFIX}:rp:{key}", timeout=ttl)

    def _acquire_waiting(self, lock: Any, timeout: float) -> bool:
        return bool(lock.acquire(blocking=True, blocking_timeout=timeout))

    def close(self) -> None:
        self.client.close()


class PythonRedisLock(PeerLock):
    """python-redis-lock: a waiter blocks in BLPOP on the lock's signal list."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, **CLIENT_OPTIONS)

    def _lock(self, key: str, ttl: float) -> Any:
        import redis_lock

        return redis_lock.Lock(self.client, f"{PREFIX}:prl:{key}", expire=int(ttl))

    def _acquire_waiting(self, lock: Any, timeout: float) -> bool:
        return bool(lock.acquire(blocking=True, timeout=max(1, int(timeout))))

    def close(self) -> None:
        self.client.close()


class PotteryLock(PeerLock):
    """pottery's Redlock over the masters in `url` (comma-separated redis:// URLs)."""

    def __init__(self, url: str) -> None:
        import redis

        self.clients = [redis.Redis.from_url(u, **CLIENT_OPTIONS) for u in url.split(",")]

    def _lock(self, key: str, ttl: float) -> Any:
        from pottery import Redlock

        return Redlock(key=f"{PREFIX}:{key}", masters=set(self.clients), auto_release_time=ttl)

    def close(self) -> None:
        for client in self.clients:
            client.close()


OPENERS: dict[str, Callable[[str], Lock]] = {
    "jobfence": JobfenceLock,
    "advisory": AdvisoryLock,
    "redis-py": RedisPyLock,
    "python-redis-lock": PythonRedisLock,
    "pottery": PotteryLock,
}


# --------------------------------------------------------------------------- client processes


def _summary_us(ns: Sequence[int]) -> dict[str, float]:
    ordered = sorted(ns)

    def pct(q: float) -> float:
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] / 1000

    return {
        "median": round(pct(50), 1),
        "p10": round(pct(10), 1),
        "p90": round(pct(90), 1),
        "p99": round(pct(99), 1),
    }


def _run(
    lock: Lock,
    warmed: Callable[[], int],
    *,
    mode: str,
    tag: str,
    seconds: float,
    warmup: int,
    timed: bool,
) -> dict[str, Any]:
    """One client's timed run: distinct keys of its own, or everybody on one key.

    `warmed()` says the warm-up is over and returns when to start (every client the same).
    """
    keys = [f"{tag}:{i}" for i in range(KEYS_PER_CLIENT)]
    for i in range(warmup):
        lock.pair(keys[i % len(keys)])
    go_at = warmed()
    deadline = go_at + int(seconds * 1e9)
    pause = (go_at - now_ns()) / 1e9
    if pause > 0:
        time.sleep(pause)
    count = refused = 0
    latencies: list[int] = []
    i = 0
    if mode == "distinct":
        while (t0 := now_ns()) < deadline:
            ok = lock.pair(keys[i % len(keys)])
            if timed:
                latencies.append(now_ns() - t0)
            i += 1
            count += ok
            refused += not ok
    else:  # contended: block on the one shared key, then release
        while now_ns() < deadline:
            release = lock.wait("contended", WAIT_TIMEOUT + seconds)
            release()
            if now_ns() <= deadline:
                count += 1
    return {
        "count": count,
        "refused": refused,
        "end": now_ns(),
        "latency_us": _summary_us(latencies) if latencies else None,
    }


def _client_main(contender: Contender, conn: Connection) -> None:
    """A client process: open the lock, then obey run / hold / release / wait messages."""
    try:
        lock = OPENERS[contender.kind](contender.url)
    except Exception as exc:
        conn.send(("error", f"cannot open: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    release: Callable[[], None] | None = None
    try:
        while (msg := conn.recv()) is not None:
            op, arg = msg
            try:
                if op == "run":

                    def warmed() -> int:
                        conn.send(("warm", None))
                        go_at: int = conn.recv()
                        return go_at

                    conn.send(("done", _run(lock, warmed, **arg)))
                elif op == "hold":
                    release = lock.hold(arg)
                    conn.send(("held", None))
                elif op == "release":
                    assert release is not None
                    stamp = now_ns()
                    release()
                    release = None
                    conn.send(("released", stamp))
                elif op == "wait":
                    conn.send(("waiting", None))
                    got = lock.wait(arg, WAIT_TIMEOUT)
                    stamp = now_ns()
                    got()
                    conn.send(("acquired", stamp))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        with contextlib.suppress(Exception):
            lock.close()


class Clients:
    """`n` client processes of one contender, started together, stopped by their handles."""

    def __init__(self, ctx: Any, contender: Contender, n: int) -> None:
        self.contender = contender
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(contender, child), daemon=True)
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)
        for p in self.pipes:
            self.expect(p, "ready", 60.0)

    def expect(self, pipe: Connection, what: str, timeout: float) -> Any:
        if not pipe.poll(timeout):
            raise MatrixError(f"{self.contender.name}: a client did not answer ({what})")
        try:
            tag, value = pipe.recv()
        except EOFError as exc:
            raise MatrixError(f"{self.contender.name}: a client died ({what})") from exc
        if tag == "error":
            raise MatrixError(f"{self.contender.name}: {value}")
        if tag != what:
            raise MatrixError(f"{self.contender.name}: expected {what}, got {tag}")
        return value

    def close(self) -> None:
        for p in self.pipes:
            with contextlib.suppress(OSError, ValueError):
                p.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for p in self.pipes:
            p.close()

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def throughput(ctx: Any, contender: Contender, n: int, mode: str, s: Settings) -> dict[str, Any]:
    """Pairs/s of `n` client processes together for `s.seconds` (and, for one, latencies)."""
    with Clients(ctx, contender, n) as clients:
        for i, p in enumerate(clients.pipes):
            p.send(
                (
                    "run",
                    {
                        "mode": mode,
                        "tag": f"c{i}-{os.getpid()}",
                        "seconds": s.seconds,
                        "warmup": s.warmup,
                        "timed": n == 1,
                    },
                )
            )
        for p in clients.pipes:
            clients.expect(p, "warm", 120.0)
        go_at = now_ns() + int(0.05e9)  # every client is waiting for it: start together
        for p in clients.pipes:
            p.send(go_at)
        timeout = s.seconds + WAIT_TIMEOUT + 30
        results = [clients.expect(p, "done", timeout) for p in clients.pipes]
    late = max(r["end"] for r in results)
    span = max(late - go_at, 1) / 1e9
    total = sum(r["count"] for r in results)
    return {
        "pairs_per_s": total / span if mode == "distinct" else total / s.seconds,
        "refused": sum(r["refused"] for r in results),
        "latency_us": results[0]["latency_us"] if n == 1 else None,
    }


def wake_up(ctx: Any, contender: Contender, s: Settings) -> dict[str, Any]:
    """Holder and waiter in two processes: release → the waiter's acquire returns, in ms."""
    rng = random.Random(s.seed)
    delays: list[float] = []
    errors: list[str] = []
    with Clients(ctx, contender, 2) as clients:
        holder, waiter = clients.pipes
        for i in range(s.wake_trials + 2):  # two warm-up trials
            key = f"wake-{os.getpid()}-{i}"
            holder.send(("hold", key))
            clients.expect(holder, "held", 10.0)
            waiter.send(("wait", key))
            clients.expect(waiter, "waiting", 10.0)
            time.sleep(SETTLE_MIN + rng.random() * SETTLE_SPAN)
            holder.send(("release", None))
            released = clients.expect(holder, "released", 10.0)
            try:
                acquired = clients.expect(waiter, "acquired", WAIT_TIMEOUT + 5)
            except MatrixError as exc:
                errors.append(str(exc))
                if len(errors) > 3:
                    break
                continue
            if i >= 2:
                delays.append((acquired - released) / 1e6)
    if not delays:
        return {"n": 0, "errors": errors}
    ordered = sorted(delays)
    return {
        "n": len(delays),
        "median_ms": round(statistics.median(delays), 3),
        "p10_ms": round(ordered[max(0, math.ceil(0.1 * len(ordered)) - 1)], 3),
        "p90_ms": round(ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)], 3),
        "max_ms": round(ordered[-1], 3),
        "errors": errors,
    }


# --------------------------------------------------------------------------- servers


@contextlib.contextmanager
def servers(
    only: Sequence[str],
    skipped: dict[str, str],
    *,
    redis_server: str = "redis-server",
    postgres: str = "",
    mariadb: str = "",
    etcd: str | None = None,
    zookeeper: str = "auto",
    quiet: bool = False,
) -> Iterator[list[Contender]]:
    """Start what `only` needs; yield the contenders that could start, skip the rest."""
    wanted = set(only)

    def say(text: str) -> None:
        if not quiet:
            print(f"  {text}", flush=True)

    def skip(group: str, why: str) -> None:
        skipped[group] = why
        say(f"skipping {group}: {why}")

    out: list[Contender] = []
    with contextlib.ExitStack() as stack:
        if "memory" in wanted:
            out.append(
                Contender(
                    "jobfence memory (in-process)",
                    "memory",
                    "jobfence",
                    "memory://",
                    True,
                    cross_process=False,
                    note="a dict per process: no wake-up across processes",
                )
            )
        redis_groups = wanted & {"redis", "redis-py", "python-redis-lock"}
        if redis_groups:
            url = _start(stack, "redis", redis_groups, skip, lambda: _redis(redis_server))
            if url:
                if "redis" in wanted:
                    out.append(Contender("jobfence Redis", "redis", "jobfence", url, True))
                if "redis-py" in wanted:
                    out.append(
                        Contender(
                            "redis-py Lock",
                            "redis-py",
                            "redis-py",
                            url,
                            False,
                            note="a waiter polls every 0.1 s",
                        )
                    )
                if "python-redis-lock" in wanted:
                    if importlib.util.find_spec("redis_lock") is None:
                        skip("python-redis-lock", "not installed (pip install 'jobfence[bench]')")
                    else:
                        out.append(
                            Contender(
                                "python-redis-lock",
                                "python-redis-lock",
                                "python-redis-lock",
                                url,
                                False,
                            )
                        )
        if wanted & {"redlock", "pottery"}:
            masters = _start(
                stack,
                "redlock",
                wanted & {"redlock", "pottery"},
                skip,
                lambda: _masters(redis_server),
            )
            if masters:
                urls, lock_url, three = masters
                if "redlock" in wanted:
                    out.append(
                        Contender("jobfence Redlock, 3 masters", "redlock", "jobfence", three, True)
                    )
                    out.append(
                        Contender(
                            "jobfence Redlock, 5 masters", "redlock", "jobfence", lock_url, True
                        )
                    )
                if "pottery" in wanted:
                    if importlib.util.find_spec("pottery") is None:
                        skip("pottery", "not installed (pip install 'jobfence[bench]')")
                    else:
                        out.append(
                            Contender(
                                "pottery Redlock, 5 masters",
                                "pottery",
                                "pottery",
                                ",".join(urls),
                                False,
                            )
                        )
        if "sentinel" in wanted:
            url = _start(stack, "sentinel", {"sentinel"}, skip, lambda: _sentinel(redis_server))
            if url:
                out.append(
                    Contender(
                        "jobfence Sentinel (master + 2 replicas)", "sentinel", "jobfence", url, True
                    )
                )
        if "cluster" in wanted:
            url = _start(stack, "cluster", {"cluster"}, skip, lambda: _cluster(redis_server))
            if url:
                out.append(
                    Contender("jobfence Cluster, 3 masters", "cluster", "jobfence", url, True)
                )
        for group, label, server in (
            ("postgres", "PostgreSQL", postgres),
            ("mariadb", "MariaDB", mariadb),
        ):
            if group not in wanted:
                continue
            if not server:
                skip(group, "no server URL given")
                continue
            db = _start(stack, group, {group}, skip, functools.partial(_scratch, label, server))
            if db:
                out.append(Contender(f"jobfence {label} lease", group, "jobfence", db, True))
                out.append(Contender(f"{label} advisory xact lock", group, "advisory", db, True))
        if "etcd" in wanted:
            url = _start(stack, "etcd", {"etcd"}, skip, functools.partial(_etcd, etcd))
            if url:
                out.append(Contender("jobfence etcd lease", "etcd", "jobfence", url, True))
        if "zookeeper" in wanted:
            url = _start(
                stack, "zookeeper", {"zookeeper"}, skip, functools.partial(_zookeeper, zookeeper)
            )
            if url:
                out.append(
                    Contender("jobfence ZooKeeper lease", "zookeeper", "jobfence", url, True)
                )
        yield out


Started = Callable[[], contextlib.AbstractContextManager[Any]]


def _start(
    stack: contextlib.ExitStack,
    what: str,
    groups: set[str],
    skip: Callable[[str, str], None],
    start: Started,
) -> Any:
    """Enter `start()` on `stack`; on failure skip every group in `groups` with the reason."""
    try:
        return stack.enter_context(start())
    except Exception as exc:
        for group in sorted(groups):
            why = f"{type(exc).__name__}: {exc}"
            skip(group, str(exc) if isinstance(exc, MatrixError) else f"cannot start {what}: {why}")
        return None


@contextlib.contextmanager
def _redis(executable: str) -> Iterator[str]:
    from devstack.redis_server import RedisServer

    if shutil.which(executable) is None:
        raise MatrixError(f"{executable!r} is not on PATH")
    with RedisServer(executable=executable) as server:
        yield server.url


@contextlib.contextmanager
def _masters(executable: str) -> Iterator[tuple[list[str], str, str]]:
    from devstack.redis_masters import RedisMasters

    if shutil.which(executable) is None:
        raise MatrixError(f"{executable!r} is not on PATH")
    with RedisMasters(5, executable=executable) as masters:
        three = "redlock://" + ",".join(f"{s.host}:{s.port}" for s in masters.servers[:3])
        yield [s.url for s in masters.servers], masters.url, three


@contextlib.contextmanager
def _sentinel(executable: str) -> Iterator[str]:
    from devstack.local_sentinel import LocalSentinel

    if shutil.which(executable) is None:
        raise MatrixError(f"{executable!r} is not on PATH")
    with LocalSentinel(executable=executable) as topology:
        yield topology.url


@contextlib.contextmanager
def _cluster(executable: str) -> Iterator[str]:
    from devstack.local_cluster import LocalCluster

    if shutil.which(executable) is None:
        raise MatrixError(f"{executable!r} is not on PATH")
    with LocalCluster(masters=3, executable=executable) as cluster:
        yield cluster.url


@contextlib.contextmanager
def _scratch(label: str, server_url: str) -> Iterator[str]:
    from devstack.bench import sql_rows

    skipped: dict[str, str] = {}
    with sql_rows.scratch_databases({label: server_url}, skipped) as dbs:
        if not dbs:
            raise MatrixError(skipped.get(label, "no scratch database"))
        yield dbs[0].url


@contextlib.contextmanager
def _etcd(given: str | None) -> Iterator[str]:
    """`given` (an etcd:// URL), or a private etcd when None; '' skips."""
    from devstack.local_etcd import EtcdCluster, etcd_unavailable

    if given is not None:
        if not given:
            raise MatrixError("not asked for (--etcd '')")
        yield given
        return
    reason = etcd_unavailable()
    if reason:
        raise MatrixError(reason)
    cluster = EtcdCluster().start()
    try:
        yield cluster.url
    finally:
        cluster.stop(kill=True)


@contextlib.contextmanager
def _zookeeper(given: str) -> Iterator[str]:
    """`given` (a zookeeper:// URL, a chroot of the run's own added), 'auto' starts a private
    server, '' skips."""
    from devstack.bench import zookeeper_rows

    skipped: dict[str, str] = {}
    with zookeeper_rows.server_url(given, skipped) as got:
        if got is None:
            raise MatrixError(skipped.get(zookeeper_rows.NAME, "no server"))
        yield got[0]


# --------------------------------------------------------------------------- the run


@dataclass
class Row:
    contender: Contender
    one: list[float] = field(default_factory=list)  # pairs/s of each round
    many: list[float] = field(default_factory=list)
    contended: list[float] = field(default_factory=list)
    latency_us: list[dict[str, float]] = field(default_factory=list)
    refused: int = 0
    wake: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


def run(
    only: Sequence[str],
    s: Settings,
    *,
    redis_server: str = "redis-server",
    postgres: str = "",
    mariadb: str = "",
    etcd: str | None = None,
    zookeeper: str = "auto",
    quiet: bool = False,
) -> dict[str, Any]:
    """Start the servers, measure every contender, return the `backends` report section."""
    ctx = multiprocessing.get_context("forkserver")
    skipped: dict[str, str] = {}
    started = time.monotonic()

    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    say("starting servers ...")
    with servers(
        only,
        skipped,
        redis_server=redis_server,
        postgres=postgres,
        mariadb=mariadb,
        etcd=etcd,
        zookeeper=zookeeper,
        quiet=quiet,
    ) as contenders:
        rows = [Row(c) for c in contenders]
        groups = {c.group for c in contenders}
        ctx.set_forkserver_preload(
            [
                "devstack.bench.matrix",
                "devstack.bench.async_rows",
                *(m for g in GROUPS if g in groups for m in PRELOAD[g]),
            ]
        )
        for r in range(s.rounds):
            for row in rows[r % max(1, len(rows)) :] + rows[: r % max(1, len(rows))]:
                if row.errors:
                    continue
                say(f"round {r + 1}/{s.rounds}: {row.contender.name} ...")
                _measure_round(ctx, row, s)
        for row in rows:
            if row.errors:
                continue
            if not row.contender.cross_process:
                row.wake = {"n": 0, "errors": [], "skipped": row.contender.note}
                continue
            say(f"wake-up: {row.contender.name} ...")
            try:
                row.wake = wake_up(ctx, row.contender, s)
            except Exception as exc:  # as above: reported in the row
                row.wake = {"n": 0, "errors": [f"{type(exc).__name__}: {exc}"]}
        # Imported here: the asyncio rows build on this module's contenders and settings.
        from devstack.bench import async_rows

        asyncio_rows = async_rows.run(ctx, contenders, s, say)
    return {
        "settings": {
            "clients": s.clients,
            "seconds_per_run": s.seconds,
            "rounds": s.rounds,
            "warmup_pairs": s.warmup,
            "wake_trials": s.wake_trials,
            "contended": s.contended,
            "settle_ms": [SETTLE_MIN * 1000, (SETTLE_MIN + SETTLE_SPAN) * 1000],
        },
        "rows": [_row_report(row) for row in rows],
        "asyncio_rows": asyncio_rows,
        "skipped": skipped,
        "seconds": round(time.monotonic() - started, 1),
    }


def _measure_round(ctx: Any, row: Row, s: Settings) -> None:
    c = row.contender
    try:
        one = throughput(ctx, c, 1, "distinct", s)
        row.one.append(one["pairs_per_s"])
        if one["latency_us"] is None:
            raise MatrixError(f"{c.name}: no pair finished within {s.seconds} s")
        row.latency_us.append(one["latency_us"])
        row.refused += one["refused"]
        many = throughput(ctx, c, s.clients, "distinct", s)
        row.many.append(many["pairs_per_s"])
        row.refused += many["refused"]
        if s.contended and c.cross_process:
            row.contended.append(throughput(ctx, c, s.clients, "contended", s)["pairs_per_s"])
    except Exception as exc:  # one contender's failure is its row's error, not the run's end
        row.errors.append(f"{type(exc).__name__}: {exc}")


def _row_report(row: Row) -> dict[str, Any]:
    c = row.contender
    lat = None
    if row.latency_us:
        # the round whose median is the median round: its spread is reported with it
        ordered = sorted(row.latency_us, key=lambda x: x["median"])
        lat = dict(ordered[len(ordered) // 2])
        lat["rounds_min"] = ordered[0]["median"]
        lat["rounds_max"] = ordered[-1]["median"]
    return {
        "name": c.name,
        "group": c.group,
        "kind": c.kind,
        "fence": c.fence,
        "note": c.note,
        "pair_us": lat,
        "pairs_per_s_1": _spread(row.one),
        "pairs_per_s_n": _spread(row.many),
        "pairs_per_s_contended": _spread(row.contended),
        "refused_free_key": row.refused,
        "wake": row.wake,
        "errors": row.errors,
    }


# --------------------------------------------------------------------------- text and markdown


def _cells(row: dict[str, Any]) -> dict[str, str]:
    lat, wake = row["pair_us"], row["wake"] or {}
    one, many, hot = row["pairs_per_s_1"], row["pairs_per_s_n"], row["pairs_per_s_contended"]
    return {
        "pair": f"{lat['median']:.0f}" if lat else "-",
        "pair_spread": f"{lat['p10']:.0f}-{lat['p90']:.0f}" if lat else "",
        "wake": f"{wake['median_ms']:.1f}" if wake.get("n") else "-",
        "wake_spread": f"{wake['p10_ms']:.1f}-{wake['p90_ms']:.1f}" if wake.get("n") else "",
        "one": f"{one['median']:.0f}" if one else "-",
        "many": f"{many['median']:.0f}" if many else "-",
        "hot": f"{hot['median']:.0f}" if hot else "-",
        "fence": "yes" if row["fence"] else "no",
    }


def format_rows(section: dict[str, Any]) -> list[str]:
    """The every-backend table as text lines."""
    st = section["settings"]
    n = st["clients"]
    out = [
        "every backend, each only in client processes of its own (one connection each):",
        "  pair: acquire+release of a free key by one client, µs (median, p10-p90 of every pair",
        "  in the median round); wake: release -> a waiter blocked in another process acquires,",
        f"  ms (median, p10-p90 of {st['wake_trials']} trials); pairs/s of 1 and {n} client "
        f"processes on keys of their own and of {n} on one key",
        f"  (blocking acquire), each run {st['seconds_per_run']} s, median of {st['rounds']} "
        "interleaved round(s)",
        "",
        f"  {'backend':<40} {'pair µs':>8} {'(p10-p90)':>12} {'wake ms':>8} {'(p10-p90)':>12} "
        f"{'1 client':>9} {f'{n} clients':>10} {f'{n} on 1 key':>11}  fence",
    ]
    for row in section["rows"]:
        c = _cells(row)
        out.append(
            f"  {row['name']:<40} {c['pair']:>8} {c['pair_spread']:>12} {c['wake']:>8} "
            f"{c['wake_spread']:>12} {c['one']:>9} {c['many']:>10} {c['hot']:>11}  {c['fence']}"
        )
        for err in row["errors"] + (row["wake"] or {}).get("errors", []):
            out.append(f"    error: {err}")
        if row["refused_free_key"]:
            out.append(f"    {row['refused_free_key']} attempt(s) refused a free key")
    for group, why in section["skipped"].items():
        out.append(f"  skipped {group}: {why}")
    from devstack.bench import async_rows

    return out + async_rows.format_rows(section.get("asyncio_rows", []))


def markdown(section: dict[str, Any], machine: dict[str, Any] | None = None) -> str:
    """The every-backend table as a Markdown table (the README's is made by this)."""
    st = section["settings"]
    n = st["clients"]
    lines = [
        f"| backend | pair µs (p10-p90) | wake-up ms (p10-p90) | pairs/s, 1 client | "
        f"pairs/s, {n} clients | pairs/s, {n} on one key | fence |",
        "|---|--:|--:|--:|--:|--:|:-:|",
    ]
    for row in section["rows"]:
        c = _cells(row)
        pair = f"{c['pair']} ({c['pair_spread']})" if c["pair_spread"] else c["pair"]
        wake = f"{c['wake']} ({c['wake_spread']})" if c["wake_spread"] else "n/a"
        lines.append(
            f"| {row['name']} | {pair} | {wake} | {c['one']} | {c['many']} | {c['hot']} "
            f"| {c['fence']} |"
        )
    for group, why in section["skipped"].items():
        lines.append(f"| {group}: skipped, {why} | | | | | | |")
    if machine is not None:
        load = machine.get("load_average")
        lines += [
            "",
            f"Measured {machine['date']} on {machine['cores']} cores ({machine['cpu']}), Python "
            f"{machine['python']}"
            + (f", load average {load[0]} at the end" if load else "")
            + f"; each throughput run {st.get('seconds_per_run', '?')} s, median of "
            f"{st.get('rounds', '?')} interleaved rounds; {st.get('wake_trials', '?')} wake-ups.",
        ]
    return "\n".join(lines)


README_BEGIN = (
    "<!-- bench locks: begin (python -m jobfence bench locks --markdown-from JSON --readme "
    "docs/benchmarks.md) -->"
)
README_END = "<!-- bench locks: end -->"


def into_readme(text: str, table: str) -> str:
    """`text` with the table between the README's two bench-locks markers replaced."""
    try:
        head, rest = text.split(README_BEGIN, 1)
        _, tail = rest.split(README_END, 1)
    except ValueError:
        raise ValueError(f"the README has no {README_BEGIN!r} ... {README_END!r} markers") from None
    return f"{head}{README_BEGIN}\n{table}\n{README_END}{tail}"
