"""Asyncio rows of `bench locks`: AsyncLocker pair latency, pairs/s of one loop of 100 coroutines.

Each row runs in a client process of its own (forked from the matrix's forkserver), on the
server its sync row used: one coroutine takes and releases one key over and over (every
pair timed), then COROUTINES coroutines in the same loop do so, each on a key of its own.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from devstack.bench.matrix import PAIR_TTL, PREFIX, Contender, MatrixError, Settings, now_ns

#: The backends whose AsyncLocker has a native asyncio store (the registry's async_store).
GROUPS = ("redis", "postgres")
COROUTINES = 100


@dataclass(frozen=True)
class AsyncRun:
    """What one client process measures (picklable: it crosses a pipe)."""

    url: str
    seconds: float
    warmup: int
    coroutines: int


async def _pair(locker: Any, key: str) -> None:
    lease = await locker.acquire(key, ttl=PAIR_TTL, blocking=False)
    if not await locker.release(lease):
        raise MatrixError("release found another owner")


async def _one_key(locker: Any, run: AsyncRun) -> list[int]:
    """One coroutine, one key: the latency of every acquire+release pair, in ns."""
    key = f"async-one-{now_ns()}"
    for _ in range(run.warmup):
        await _pair(locker, key)
    latencies: list[int] = []
    deadline = now_ns() + int(run.seconds * 1e9)
    while (t0 := now_ns()) < deadline:
        await _pair(locker, key)
        latencies.append(now_ns() - t0)
    return latencies


async def _many_keys(locker: Any, run: AsyncRun) -> float:
    """`run.coroutines` coroutines in this loop, each on a key of its own: pairs/s together."""
    tag = now_ns()
    await asyncio.gather(*(_pair(locker, f"async-w{tag}-{i}") for i in range(run.coroutines)))
    started = now_ns()
    deadline = started + int(run.seconds * 1e9)

    async def worker(i: int) -> int:
        count = 0
        while now_ns() < deadline:
            await _pair(locker, f"async-{tag}-{i}")
            count += 1
        return count

    total = sum(await asyncio.gather(*(worker(i) for i in range(run.coroutines))))
    return total / (max(now_ns() - started, 1) / 1e9)


async def _measure(run: AsyncRun) -> dict[str, Any]:
    from jobfence import AsyncLocker

    locker = AsyncLocker.from_url(run.url, prefix=PREFIX)
    try:
        latencies = await _one_key(locker, run)
        pairs_per_s = await _many_keys(locker, run)
    finally:
        await locker.aclose()
    ordered = sorted(latencies)
    return {
        "pair_us": {
            "median": round(statistics.median(ordered) / 1000, 1),
            "p10": round(ordered[len(ordered) // 10] / 1000, 1),
            "p90": round(ordered[min(len(ordered) - 1, len(ordered) * 9 // 10)] / 1000, 1),
            "n": len(ordered),
        },
        "pairs_per_s": round(pairs_per_s, 1),
    }


def _client_main(run: AsyncRun, conn: Any) -> None:
    """A client process: one asyncio loop, one measurement, its result on the pipe."""
    try:
        conn.send(("done", asyncio.run(_measure(run))))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _measure_in_a_process(ctx: Any, run: AsyncRun) -> dict[str, Any]:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_client_main, args=(run, child), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(2 * run.seconds + 60):
            raise MatrixError("the asyncio client did not answer")
        tag, value = parent.recv()
    except EOFError as exc:
        raise MatrixError("the asyncio client died") from exc
    finally:
        parent.close()
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
    if tag != "done":
        raise MatrixError(str(value))
    result: dict[str, Any] = value
    return result


def run(
    ctx: Any, contenders: Sequence[Contender], s: Settings, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """An asyncio row for each jobfence contender of GROUPS, `s.rounds` runs each (median)."""
    rows = []
    for c in contenders:
        if c.kind != "jobfence" or c.group not in GROUPS:
            continue
        name = f"{c.name}, asyncio (AsyncLocker)"
        runs: list[dict[str, Any]] = []
        errors: list[str] = []
        for r in range(s.rounds):
            say(f"asyncio round {r + 1}/{s.rounds}: {name} ...")
            try:
                runs.append(_measure_in_a_process(
                    ctx, AsyncRun(c.url, s.seconds, s.warmup, COROUTINES)
                ))  # fmt: skip
            except Exception as exc:  # one row's failure is its error, not the run's end
                errors.append(f"{type(exc).__name__}: {exc}")
                break
        rows.append(_row(name, c.group, runs, errors))
    return rows


def _row(name: str, group: str, runs: list[dict[str, Any]], errors: list[str]) -> dict[str, Any]:
    pair = None
    if runs:  # the round whose median is the median round, with its spread
        ordered = sorted((r["pair_us"] for r in runs), key=lambda p: p["median"])
        pair = ordered[len(ordered) // 2]
    tput = [r["pairs_per_s"] for r in runs]
    return {
        "name": name,
        "group": group,
        "coroutines": COROUTINES,
        "pair_us": pair,
        "pairs_per_s_coroutines": (
            {"median": round(statistics.median(tput), 1), "min": min(tput), "max": max(tput)}
            if tput
            else None
        ),
        "errors": errors,
    }


def format_rows(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The asyncio rows as text lines, under the every-backend table."""
    if not rows:
        return []
    out = [
        "",
        "asyncio (AsyncLocker, one loop in a client process of its own): pair: acquire+release",
        "  of one key by one coroutine, µs (median, p10-p90); pairs/s of "
        f"{COROUTINES} coroutines in that loop, each on a key of its own",
        "",
        f"  {'backend':<52} {'pair µs':>8} {'(p10-p90)':>12} {f'{COROUTINES} coroutines':>15}",
    ]
    for row in rows:
        pair, tput = row["pair_us"], row["pairs_per_s_coroutines"]
        spread = f"{pair['p10']:.0f}-{pair['p90']:.0f}" if pair else ""
        median = f"{pair['median']:.0f}" if pair else "-"
        many = f"{tput['median']:.0f}" if tput else "-"
        out.append(f"  {row['name']:<52} {median:>8} {spread:>12} {many:>15}")
        out += [f"    error: {err}" for err in row["errors"]]
    return out
