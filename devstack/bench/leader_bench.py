"""Leader hand-over benchmark: how long a standby process takes to lead after the leader is
killed (SIGKILL), frozen (SIGSTOP) or exits cleanly (SIGTERM), per lock backend.

Each round forks a leader and a standby (real processes, connections and keepers of their
own) campaigning for one election; the time runs from the signal to the standby's election,
both read on the host's monotonic clock. A frozen leader is resumed after its successor is
elected and reports whether it read its term as lost before anything else (it must).
A private redis-server is used unless `--lock-url` is given (repeatable: PostgreSQL,
MariaDB, etcd, ... URLs).

    python -m jobfence bench leader [--rounds 5] [--ttl 1.0] [--lock-url URL ...] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from devstack.redis_server import RedisServer
from jobfence.locks import Locker, open_backend

SCENARIOS = ("kill", "freeze", "clean")
SIGNALS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP, "clean": signal.SIGTERM}
START_TIMEOUT = 30.0


def _contender(url: str, prefix: str, name: str, ttl: float, pipe: Connection) -> None:
    """A forked process: campaign, tell the parent when elected, lead until told to stop;
    after a freeze, tell whether the term read as lost on waking."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    locker = Locker(open_backend(url, prefix=prefix), ttl=ttl)
    pipe.send(("campaign", time.monotonic(), 0))
    with locker.leader(name) as term:
        pipe.send(("elected", time.monotonic(), term.fence))
        while not stop.is_set():
            before = time.monotonic()
            lost = term.lost.wait(0.02)
            frozen = time.monotonic() - before > ttl  # stopped past its TTL in that wait
            if lost or frozen:  # its first read of the term after waking: lost, or a bug
                pipe.send(("woke", time.monotonic(), int(lost)))
                break
    locker.close()
    pipe.close()
    os._exit(0)


class Round:
    """One leader and one standby, forked; `events[i]` are what contender i sent."""

    def __init__(self, url: str, ttl: float) -> None:
        self.ctx = multiprocessing.get_context("fork")
        prefix, name = f"lb{uuid.uuid4().hex[:8]}", "bench"
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(2):
            parent, child = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=_contender, args=(url, prefix, name, ttl, child))
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)

    def next_event(self, i: int, want: str, timeout: float) -> tuple[str, float, int]:
        if not self.pipes[i].poll(timeout):
            raise TimeoutError(f"no {want!r} from contender {i} within {timeout:g}s")
        event: tuple[str, float, int] = self.pipes[i].recv()
        if event[0] != want:
            raise RuntimeError(f"contender {i} sent {event[0]!r}, expected {want!r}")
        return event

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)


def one_round(url: str, ttl: float, scenario: str) -> dict[str, Any]:
    r = Round(url, ttl)
    try:
        for i in (0, 1):
            r.next_event(i, "campaign", START_TIMEOUT)
        # Whoever is elected first leads; the other stands by.
        ready = multiprocessing.connection.wait(r.pipes, START_TIMEOUT)
        if not ready:
            raise TimeoutError("nobody was elected")
        leader = r.pipes.index(ready[0])  # type: ignore[arg-type]
        standby = 1 - leader
        _, _, old_fence = r.next_event(leader, "elected", 1)
        pid = r.procs[leader].pid
        assert pid is not None
        os.kill(pid, SIGNALS[scenario])
        signalled = time.monotonic()
        _, at, fence = r.next_event(standby, "elected", 5 * ttl + 5)
        result: dict[str, Any] = {"handover": at - signalled, "higher_fence": fence > old_fence}
        if scenario == "freeze":
            os.kill(pid, signal.SIGCONT)
            what, _, lost = r.pipes[leader].recv() if r.pipes[leader].poll(5) else ("", 0, 0)
            result["told_on_waking"] = what == "woke" and bool(lost)
        return result
    finally:
        r.close()


def bench(url: str, label: str, ttl: float, rounds: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for scenario in SCENARIOS:
        runs = [one_round(url, ttl, scenario) for _ in range(rounds)]
        times = [run["handover"] for run in runs]
        rows[scenario] = {
            "min": min(times),
            "median": statistics.median(times),
            "max": max(times),
            "higher_fence": all(run["higher_fence"] for run in runs),
            "told_on_waking": all(run.get("told_on_waking", True) for run in runs),
        }
    return {"backend": label, "ttl": ttl, "rounds": rounds, "scenarios": rows}


def report(results: list[dict[str, Any]]) -> str:
    lines = [
        f"leader hand-over, {platform.node()} ({os.cpu_count()} cores), load "
        f"{os.getloadavg()[0]:.1f}: seconds from the signal to the standby's election",
        "",
        "| backend | TTL | scenario | min | median | max | higher fence | told on waking |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for scenario, row in res["scenarios"].items():
            told = "yes" if row["told_on_waking"] else "NO"
            lines.append(
                f"| {res['backend']} | {res['ttl']:g} s | {scenario} | {row['min']:.3f} | "
                f"{row['median']:.3f} | {row['max']:.3f} | "
                f"{'yes' if row['higher_fence'] else 'NO'} | "
                f"{told if scenario == 'freeze' else '-'} |"
            )
    return "\n".join(lines)


@contextlib.contextmanager
def lock_urls(given: list[str]) -> Iterator[list[tuple[str, str]]]:
    if given:
        yield [(url.split("://", 1)[0], url) for url in given]
        return
    with RedisServer() as server:
        yield [("redis (private)", server.url)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jobfence bench leader",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds per scenario (5)")
    parser.add_argument("--ttl", type=float, default=1.0, help="the leader's TTL, seconds (1.0)")
    parser.add_argument("--lock-url", action="append", default=[], help="a lock backend URL")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.ttl <= 0:
        parser.error("--rounds must be >= 1 and --ttl > 0")
    with lock_urls(args.lock_url) as urls:
        results = [bench(url, label, args.ttl, args.rounds) for label, url in urls]
    print(json.dumps(results, indent=2) if args.json else report(results))
    ok = all(
        row["higher_fence"] and row["told_on_waking"]
        for res in results
        for row in res["scenarios"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
