"""The lock benchmark's etcd row: pairs and wake-up on an etcd lease, measured like the SQL rows."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

from devstack.bench import sql_rows
from devstack.local_etcd import EtcdCluster, EtcdServerError, etcd_unavailable
from jobfence import locks
from jobfence.locks.backends.etcd import EtcdBackend

NAME = "etcd lease"
PROBE_PAIRS = 100  # pairs over which requests per pair are counted


@contextlib.contextmanager
def etcd_server(url: str | None) -> Iterator[tuple[str, str]]:
    """(lock URL, where) of the etcd to measure: `url`, or a private one started here (its
    data directory in a temporary directory, on disk like a real member's)."""
    if url:
        yield url, "given"
        return
    reason = etcd_unavailable()
    if reason:
        raise EtcdServerError(reason)
    cluster = EtcdCluster().start()
    try:
        yield cluster.url, f"private etcd, data in {cluster.workdir}"
    finally:
        cluster.stop(kill=True)


def _version(url: str) -> str:
    backend = locks.open_backend(url)
    assert isinstance(backend, EtcdBackend)
    try:
        return str(backend.gateway.get("/version").get("etcdserver", "?"))
    finally:
        backend.close()


def _requests_per_pair(url: str) -> float:
    backend = locks.open_backend(url, prefix="bench-probe")
    assert isinstance(backend, EtcdBackend)
    try:
        lease = backend.try_acquire("probe", sql_rows.PAIR_TTL)  # lease and fence base made
        assert lease is not None and lease.release()
        before = backend.requests
        for _ in range(PROBE_PAIRS):
            lease = backend.try_acquire("probe", sql_rows.PAIR_TTL)
            if lease is None or not lease.release():
                raise sql_rows.SqlBenchError("etcd probe: a free key was refused")
        return (backend.requests - before) / PROBE_PAIRS
    finally:
        backend.close()


def run(
    url: str | None, *, pairs: int, rounds: int, warmup: int, trials: int, seed: int | None
) -> dict[str, Any]:
    """The etcd row, or the reason it was skipped (`url` '' skips; None starts a private one)."""
    if url == "":
        return {"skipped": "not asked for (empty --etcd)"}
    try:
        with etcd_server(url) as (lock_url, where):
            version = _version(lock_url)
            row = sql_rows.SqlLock(NAME, "lease", lock_url)
            started = time.monotonic()
            sql_rows.run_pairs([row], pairs=pairs, rounds=rounds, warmup=warmup)
            sql_rows.run_wakeup([row], trials=trials, seed=seed)
            per_pair = _requests_per_pair(lock_url)
            seconds = time.monotonic() - started
    except (EtcdServerError, locks.LockError) as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    (reported,) = sql_rows.report_rows([row], pairs=pairs)
    reported["requests_per_pair"] = per_pair
    wake = row.delays_ms
    return {
        "server": {"version": version, "where": where},
        "row": reported,
        "seconds": round(seconds, 1),
        "targets": {
            "etcd_pair_under_3ms": reported["us_per_pair"] is not None
            and reported["us_per_pair"] < 3000,
            "etcd_wakeup_median_under_10ms": bool(wake) and statistics.median(wake) < 10.0,
        },
    }


def format_rows(etcd: dict[str, Any]) -> list[str]:
    if "skipped" in etcd:
        return ["", f"etcd: skipped ({etcd['skipped']})"]
    r = etcd["row"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    spread = f"({r['us_per_pair_min']:.0f}-{r['us_per_pair_max']:.0f})"
    out = [
        "",
        f"etcd lock backend, same run: etcd {etcd['server']['version']} "
        f"({etcd['server']['where']}); pairs and wake-up as for the SQL rows",
        "",
        f"  {'lock':<30} {'µs/pair':>8} {'(min-max)':>13} {'pairs/s':>8} "
        f"{'wake med ms':>11} {'p95 ms':>8} {'n':>4} {'reqs':>5}",
        f"  {r['name']:<30} {r['us_per_pair']:>8.1f} {spread:>13} {r['pairs_per_s']:>8.0f} "
        f"{ms(r['wake_median_ms']):>11} {ms(r['wake_p95_ms']):>8} {r['wake_n']:>4} "
        f"{r['requests_per_pair']:>5.1f}",
        "  reqs: HTTP requests per acquire+release pair (the grant txn, the release txn)",
    ]
    if r["wake_errors"]:
        out.append(f"    {len(r['wake_errors'])} wake-up error(s), first: {r['wake_errors'][0]}")
    return out
