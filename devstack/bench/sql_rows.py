"""The lock benchmark's SQL rows: PostgreSQL and MariaDB leases and advisory transaction locks."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import random
import secrets
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from jobfence import locks
from jobfence.locks import Lease, LockBackend, advisory
from jobfence.locks.guards import fences
from jobfence.locks.sql import ensure_tables

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DEFAULT_MARIADB = "mysql+pymysql://root@127.0.0.1:3306/test"
PAIR_TTL = 10.0
HOLD_TTL = 30.0
WAIT_TIMEOUT = 10.0
SETTLE_MIN = 0.005
SETTLE_SPAN = 0.100
# The seed article's figures, quoted beside ours as the anchor (not measured here).
ANCHOR = "seed article: PostgreSQL advisory lock ~2 ms, Redis lock ~1 ms per acquire+release"


class SqlBenchError(RuntimeError):
    """A SQL row could not run (server, scratch database) or a lock misbehaved."""


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# --------------------------------------------------------------------------- scratch databases


@dataclass
class Scratch:
    """A database created for this run on `server_url`'s server, dropped by `drop()`."""

    label: str  # "PostgreSQL" / "MariaDB"
    server_url: str
    url: str = ""
    version: str = ""
    name: str = field(
        default_factory=lambda: f"jobfence_bench_{os.getpid()}_{secrets.token_hex(4)}"
    )

    def create(self) -> Scratch:
        admin = sa.create_engine(self.server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f"CREATE DATABASE {self._quoted()}"))
                version = str(conn.execute(sa.text("SELECT version()")).scalar_one())
                self.version = version.split(" on ", 1)[0]  # PostgreSQL adds the build
        finally:
            admin.dispose()
        self.url = (
            sa.make_url(self.server_url)
            .set(database=self.name)
            .render_as_string(hide_password=False)
        )
        return self

    def drop(self) -> None:
        admin = sa.create_engine(self.server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        force = " WITH (FORCE)" if self.label == "PostgreSQL" else ""
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {self._quoted()}{force}"))
        finally:
            admin.dispose()

    def _quoted(self) -> str:
        return f'"{self.name}"' if self.label == "PostgreSQL" else f"`{self.name}`"


@contextlib.contextmanager
def scratch_databases(
    servers: dict[str, str | None], skipped: dict[str, str]
) -> Iterator[list[Scratch]]:
    """A scratch database on each server given; a server that fails is skipped with a reason."""
    made: list[Scratch] = []
    try:
        for label, url in servers.items():
            if not url:
                skipped[label] = "not asked for (empty URL)"
                continue
            try:
                made.append(Scratch(label, url).create())
            except (SQLAlchemyError, ImportError) as exc:
                skipped[label] = f"cannot create a scratch database: {type(exc).__name__}: {exc}"
        yield made
    finally:
        for db in made:
            with contextlib.suppress(SQLAlchemyError):
                db.drop()


# --------------------------------------------------------------------------- the locks


@dataclass
class SqlLock:
    """One SQL lock to measure: a pair (acquire+release) and a holder/waiter for wake-up."""

    name: str
    kind: str  # "lease" or "advisory"
    url: str
    seconds: list[float] = field(default_factory=list)
    delays_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def lease_backend(url: str) -> LockBackend:
    """The lease backend registered for `url`'s scheme, or for its scheme without the driver.

    Raises ValueError when neither is registered.
    """
    try:
        return locks.open_backend(url)
    except ValueError as exc:
        scheme, rest = url.split("://", 1)
        if "+" not in scheme:
            raise
        try:
            return locks.open_backend(f"{scheme.split('+', 1)[0]}://{rest}")
        except ValueError:
            raise exc from None


def plan(dbs: list[Scratch], skipped: dict[str, str]) -> list[SqlLock]:
    """The rows to run: a lease row where its scheme is registered, and the advisory row."""
    rows: list[SqlLock] = []
    for db in dbs:
        name = f"{db.label} lease"
        try:
            backend = lease_backend(db.url)
        except (ValueError, ImportError) as exc:
            skipped[name] = f"no lease backend for this URL yet ({exc})"
        else:
            backend.close()
            rows.append(SqlLock(name, "lease", db.url))
        rows.append(SqlLock(f"{db.label} advisory xact lock", "advisory", db.url))
    return rows


def _pair(lock: SqlLock) -> tuple[Callable[[], None], Callable[[], None]]:
    """(pair, close) for `lock`: one acquire+release of a free key per call."""
    if lock.kind == "lease":
        backend = lease_backend(lock.url)

        def lease_pair() -> None:
            lease = backend.try_acquire("pair", PAIR_TTL)
            if lease is None:
                raise SqlBenchError(f"{lock.name} refused a free key")
            if not lease.release():
                raise SqlBenchError(f"{lock.name}: release found another owner")

        return lease_pair, backend.close
    engine = sa.create_engine(lock.url, pool_size=1)
    ensure_tables(engine, [fences])

    def advisory_pair() -> None:
        with engine.begin() as conn, advisory.try_transaction_lock(conn, "pair") as fence:
            if fence is None:
                raise SqlBenchError(f"{lock.name} refused a free key")

    return advisory_pair, engine.dispose


def run_pairs(rows: list[SqlLock], *, pairs: int, rounds: int, warmup: int) -> None:
    """Sequential loops, rounds interleaved between the rows like the Redis table."""
    made = [(row, *_pair(row)) for row in rows]
    try:
        for _, pair, _ in made:
            for _ in range(warmup):
                pair()
        for r in range(rounds):
            for row, pair, _ in made[r % len(made) :] + made[: r % len(made)]:
                gc.collect()
                started = time.perf_counter()
                for _ in range(pairs):
                    pair()
                row.seconds.append(time.perf_counter() - started)
    finally:
        for _, _, close in made:
            close()


# --------------------------------------------------------------------------- wake-up


def _waiter_main(conn: Connection, rows: list[tuple[str, str, str]]) -> None:
    """The waiter process: for each (row, key) say 'ready', block until acquired, stamp."""
    backends = {name: lease_backend(url) for name, kind, url in rows if kind == "lease"}
    engines = {name: sa.create_engine(url) for name, kind, url in rows if kind == "advisory"}
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            name, key = msg
            try:
                if name in backends:
                    conn.send((key, "ready", 0))
                    lease = locks.acquire(backends[name], key, ttl=HOLD_TTL, timeout=WAIT_TIMEOUT)
                    stamp = now_ns()
                    lease.release()
                else:
                    with engines[name].begin() as tx:
                        conn.send((key, "ready", 0))
                        with advisory.transaction_lock(tx, key, timeout=WAIT_TIMEOUT):
                            stamp = now_ns()
            except Exception as exc:
                conn.send((key, "error", f"{type(exc).__name__}: {exc}"))
            else:
                conn.send((key, "ok", stamp))
    finally:
        for backend in backends.values():
            backend.close()
        for engine in engines.values():
            engine.dispose()


class _Holder:
    """Holds a key for one trial in this process: a lease, or a lock in an open transaction."""

    def __init__(self, lock: SqlLock) -> None:
        self.lock = lock
        self.backend = lease_backend(lock.url) if lock.kind == "lease" else None
        self.engine = sa.create_engine(lock.url, pool_size=1) if lock.kind == "advisory" else None

    def hold(self, key: str) -> Callable[[], None]:
        if self.backend is not None:
            lease = self.backend.try_acquire(key, HOLD_TTL)
            if not isinstance(lease, Lease):
                raise SqlBenchError(f"{self.lock.name}: holder could not take {key}")

            def release() -> None:
                if not lease.release():
                    raise SqlBenchError(f"{self.lock.name}: release found another owner")

            return release
        assert self.engine is not None
        conn = self.engine.connect()
        tx = conn.begin()
        with advisory.try_transaction_lock(conn, key) as fence:
            if fence is None:
                conn.close()
                raise SqlBenchError(f"{self.lock.name}: holder could not take {key}")

        def commit() -> None:
            tx.commit()  # the release: pg at commit, GET_LOCK right after it
            conn.close()

        return commit

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        if self.engine is not None:
            self.engine.dispose()


def _recv(conn: Connection, key: str, timeout: float) -> tuple[str, Any]:
    deadline = time.monotonic() + timeout
    while True:  # replies to earlier, failed trials may still be queued: skip them
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise SqlBenchError("the waiter did not answer")
        reply_key, status, value = conn.recv()
        if reply_key == key:
            return status, value


def _trial(holder: _Holder, key: str, conn: Connection, rng: random.Random) -> float:
    release = holder.hold(key)
    try:
        conn.send((holder.lock.name, key))
        status, value = _recv(conn, key, 10.0)
        if status != "ready":
            raise SqlBenchError(f"waiter failed before waiting: {value}")
        # The waiter is in its first attempt now, or about to be.
        time.sleep(SETTLE_MIN + rng.random() * SETTLE_SPAN)
        released_at = now_ns()
    finally:
        release()
    status, value = _recv(conn, key, WAIT_TIMEOUT + 5.0)
    if status != "ok":
        raise SqlBenchError(f"waiter failed: {value}")
    if value < released_at:
        raise SqlBenchError("the waiter acquired before the release")
    return float((value - released_at) / 1e6)


def run_wakeup(
    rows: list[SqlLock], *, trials: int, warmup: int = 3, seed: int | None = None
) -> None:
    """Holder here, one waiter in another process; time from release to acquisition."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    spec = [(r.name, r.kind, r.url) for r in rows]
    proc = ctx.Process(
        target=_waiter_main, args=(child, spec), name="bench-sql-waiter", daemon=True
    )
    proc.start()
    child.close()
    rng = random.Random(seed)
    holders = [_Holder(r) for r in rows]
    try:
        for h in holders:
            for i in range(warmup):
                _trial(h, f"wake-warm-{i}-{secrets.token_hex(4)}", parent, rng)
        for i in range(trials):
            for h in holders:
                try:
                    h.lock.delays_ms.append(
                        _trial(h, f"wake-{i}-{secrets.token_hex(4)}", parent, rng)
                    )
                except SqlBenchError as exc:
                    h.lock.errors.append(str(exc))
                    if not proc.is_alive():
                        raise
    finally:
        with contextlib.suppress(OSError, ValueError):
            parent.send(None)
        proc.join(5.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        parent.close()
        for h in holders:
            h.close()


# --------------------------------------------------------------------------- report


def report_rows(rows: list[SqlLock], *, pairs: int) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        med = statistics.median(r.seconds) if r.seconds else None
        d = r.delays_ms
        out.append(
            {
                "name": r.name,
                "kind": r.kind,
                "pairs_per_s": round(pairs / med, 1) if med else None,
                "us_per_pair": round(med / pairs * 1e6, 1) if med else None,
                "us_per_pair_min": round(min(r.seconds) / pairs * 1e6, 1) if med else None,
                "us_per_pair_max": round(max(r.seconds) / pairs * 1e6, 1) if med else None,
                "wake_n": len(d),
                "wake_median_ms": round(statistics.median(d), 3) if d else None,
                "wake_p95_ms": round(sorted(d)[max(0, int(0.95 * len(d) + 0.999) - 1)], 3)
                if d
                else None,
                "wake_errors": r.errors,
            }
        )
    return out


def targets(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """The issue's targets for the lease rows that ran (none for rows that were skipped)."""
    by = {r["name"]: r for r in rows}
    out: dict[str, bool] = {}
    pg, my = by.get("PostgreSQL lease"), by.get("MariaDB lease")
    if pg and pg["us_per_pair"] is not None:
        out["postgres_pair_under_1ms"] = pg["us_per_pair"] < 1000
        out["postgres_wakeup_median_under_5ms"] = (
            pg["wake_median_ms"] is not None and pg["wake_median_ms"] < 5.0
        )
    if my and my["us_per_pair"] is not None:
        out["mariadb_pair_under_2ms"] = my["us_per_pair"] < 2000
    return out


def format_rows(
    rows: list[dict[str, Any]], skipped: dict[str, str], redis_row: dict[str, Any], redis_wake: Any
) -> list[str]:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    redis_spread = f"({redis_row['us_per_pair_min']:.0f}-{redis_row['us_per_pair_max']:.0f})"
    out = [
        "",
        "SQL lock backends, same run (pairs: one client, sequential; wake-up: as above,",
        "the waiter says 'ready' just before its first attempt)",
        "",
        f"  {'lock':<30} {'µs/pair':>8} {'(min-max)':>13} {'pairs/s':>8} "
        f"{'wake med ms':>11} {'p95 ms':>8} {'n':>4}",
        f"  {redis_row['name']:<30} {redis_row['us_per_pair']:>8.1f} "
        f"{redis_spread:>13} "
        f"{redis_row['pairs_per_s']:>8.0f} {ms(redis_wake['median_ms']):>11} "
        f"{ms(redis_wake['p95_ms']):>8} {redis_wake['n']:>4}",
    ]
    for r in rows:
        spread = (
            f"({r['us_per_pair_min']:.0f}-{r['us_per_pair_max']:.0f})"
            if r["us_per_pair"] is not None
            else ""
        )
        us = "-" if r["us_per_pair"] is None else f"{r['us_per_pair']:.1f}"
        ps = "-" if r["pairs_per_s"] is None else f"{r['pairs_per_s']:.0f}"
        out.append(
            f"  {r['name']:<30} {us:>8} {spread:>13} {ps:>8} "
            f"{ms(r['wake_median_ms']):>11} {ms(r['wake_p95_ms']):>8} {r['wake_n']:>4}"
        )
        if r["wake_errors"]:
            out.append(
                f"    {len(r['wake_errors'])} wake-up error(s), first: {r['wake_errors'][0]}"
            )
    out.append(f"  anchor: {ANCHOR}")
    for name, reason in skipped.items():
        out.append(f"  skipped {name}: {reason}")
    return out
