"""The lock benchmark's ZooKeeper row: acquire+release pairs and wake-up on a ZooKeeper lease."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

from devstack import local_zookeeper
from devstack.bench import sql_rows
from devstack.local_zookeeper import ZooKeeperError, ZooKeeperServer

NAME = "ZooKeeper lease"
AUTO = "auto"  # start a private standalone server for the run
PAIR_TARGET_US = 3000
WAKE_TARGET_MS = 10.0


@contextlib.contextmanager
def server_url(given: str, skipped: dict[str, str]) -> Iterator[tuple[str, str] | None]:
    """(URL with a chroot of this run's own, what it is) for `given`: a zookeeper:// URL, or
    'auto' to start a private server here; None (with the reason in `skipped`) if neither."""
    chroot = f"/jobfence-bench-{uuid.uuid4().hex[:8]}"
    if not given:
        skipped[NAME] = "not asked for (empty URL)"
        yield None
        return
    if given != AUTO:
        yield given.rstrip("/") + chroot, "given server"
        return
    reason = local_zookeeper.unavailable()
    if reason is not None:
        skipped[NAME] = f"cannot start a private server: {reason}"
        yield None
        return
    started = time.monotonic()
    try:
        server = ZooKeeperServer().start()
    except ZooKeeperError as exc:
        skipped[NAME] = f"cannot start a private server: {exc}"
        yield None
        return
    try:
        took = time.monotonic() - started
        yield server.url + chroot, f"private server, serving after {took:.1f}s"
    finally:
        server.stop()


def version(url: str) -> str:
    """The server's version line (`srvr`), or '?' if it does not answer it."""
    hosts = url.split("://", 1)[1].split("/", 1)[0].split(",")
    host, _, port = hosts[0].rpartition(":")
    try:
        answer = local_zookeeper.four_letter_word(host, int(port), "srvr")
    except (OSError, ValueError):
        return "?"
    first = answer.splitlines()[0] if answer else ""
    return first.replace("Zookeeper version: ", "ZooKeeper ").split(",", 1)[0] or "?"


def run(
    given: str, *, pairs: int, rounds: int, warmup: int, trials: int, seed: int | None,
    quiet: bool,
) -> dict[str, Any]:  # fmt: skip
    """Pairs and wake-up for the ZooKeeper lease (the SQL rows' loops, on its URL)."""
    skipped: dict[str, str] = {}
    rows: list[sql_rows.SqlLock] = []
    where, ver = "", ""
    with server_url(given, skipped) as found:
        if found is not None:
            url, where = found
            ver = version(url)
            if not quiet:
                print(f"running the ZooKeeper row on {ver} ({where}) ...", flush=True)
            rows = [sql_rows.SqlLock(NAME, "lease", url)]
            sql_rows.run_pairs(rows, pairs=pairs, rounds=rounds, warmup=warmup)
            sql_rows.run_wakeup(rows, trials=trials, seed=seed)
    reported = sql_rows.report_rows(rows, pairs=pairs)
    return {
        "server": {"version": ver, "where": where},
        "pairs_per_round": pairs,
        "rows": reported,
        "skipped": skipped,
        "targets": targets(reported),
    }


def targets(rows: list[dict[str, Any]]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for r in rows:
        if r["name"] == NAME and r["us_per_pair"] is not None:
            out["zookeeper_pair_under_3ms"] = r["us_per_pair"] < PAIR_TARGET_US
            out["zookeeper_wakeup_median_under_10ms"] = (
                r["wake_median_ms"] is not None and r["wake_median_ms"] < WAKE_TARGET_MS
            )
    return out


def format_rows(report: dict[str, Any]) -> list[str]:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    out = ["", "ZooKeeper lease, same run (pairs: one client, sequential; wake-up: as above)"]
    if report["server"]["version"]:
        out.append(f"  server: {report['server']['version']} ({report['server']['where']})")
    for r in report["rows"]:
        if r["us_per_pair"] is None:
            continue
        spread = f"({r['us_per_pair_min']:.0f}-{r['us_per_pair_max']:.0f})"
        out.append(
            f"  {r['name']:<30} {r['us_per_pair']:>8.1f} µs/pair {spread:>13} "
            f"{r['pairs_per_s']:>6.0f} pairs/s  wake-up median {ms(r['wake_median_ms'])} ms, "
            f"p95 {ms(r['wake_p95_ms'])} ms, n={r['wake_n']}"
        )
        if r["wake_errors"]:
            first = r["wake_errors"][0]
            out.append(f"    {len(r['wake_errors'])} wake-up error(s), first: {first}")
    for name, reason in report["skipped"].items():
        out.append(f"  skipped {name}: {reason}")
    return out
