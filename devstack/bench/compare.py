"""Before/after in one run: the gate and Celery benches on an old revision and this tree, in turn.

    python -m devstack.bench.compare --before 31329d2            # --quick sizes, 3 rounds
    python -m devstack.bench.compare --before main --full --rounds 5

The before-revision is checked out into a temporary `git worktree add --detach` (removed at
the end, whatever happens). Each round runs `python -m jobfence bench gate` and `bench celery`
in the before tree, then in this one (A B A B ...), with the same interpreter on the same
machine; each bench starts its own private redis-server from the same executable. The table
gives, per metric, the median of the rounds before and after and the change in percent, with
the direction that counts as worse (latency up, throughput down) marked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[2]  # the repository root of this tree

#: The bench arguments: --quick finishes in about 3 minutes on 2 loaded cores (3 rounds).
QUICK = {
    "gate": ["--calls", "1000", "--rounds", "3", "--warmup", "200", "--no-pieces"],
    "celery": ["--jobs", "500", "--storm", "200", "--rounds", "1", "--workers", "2",
               "--concurrency", "2"],
}  # fmt: skip
FULL: dict[str, list[str]] = {"gate": ["--no-pieces"], "celery": []}


@dataclass(frozen=True)
class Metric:
    """One number read from a bench's JSON; `higher_is_better` sets which change is worse."""

    bench: str
    name: str
    read: Callable[[dict[str, Any]], float]
    higher_is_better: bool


def _row(name: str, field: str) -> Callable[[dict[str, Any]], float]:
    def read(report: dict[str, Any]) -> float:
        rows = report.get("rows") or report.get("contenders") or []
        return float(next(r[field] for r in rows if r["name"] == name))

    return read


def _top(field: str) -> Callable[[dict[str, Any]], float]:
    return lambda report: float(report[field])


METRICS = (
    Metric("gate", "pair µs (try_acquire + release)", _row("pair: try_acquire + release",
                                                           "us_per_call"), False),
    Metric("gate", "gated call µs", _row("gated @singleton_task call", "us_per_call"), False),
    Metric("gate", "gated call CPU µs", _row("gated @singleton_task call", "cpu_us_per_call"),
           False),
    Metric("gate", "plain call µs", _row("plain Celery task call", "us_per_call"), False),
    Metric("gate", "gated / pair ratio", _top("ratio"), False),
    Metric("celery", "plain Celery jobs/s", _row("plain Celery task", "jobs_per_s"), True),
    Metric("celery", "jobfence jobs/s", _row("jobfence @singleton_task", "jobs_per_s"), True),
    Metric("celery", "jobfence vs plain", _row("jobfence @singleton_task", "vs_plain"), True),
)  # fmt: skip


class CompareError(RuntimeError):
    """A bench failed or a revision could not be checked out."""


@contextmanager
def before_tree(rev: str, repo: Path = HERE) -> Iterator[Path]:
    """`rev` checked out (detached) in a temporary git worktree, removed on the way out."""
    parent = Path(tempfile.mkdtemp(prefix="jobfence-before-"))
    path = parent / "tree"
    done = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(path), rev],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        parent.rmdir()
        raise CompareError(f"git worktree add {rev!r} failed: {done.stderr.strip()}; "
                           "give --before a commit or branch this repository has")  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)],
                       capture_output=True)  # fmt: skip
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)
        shutil.rmtree(parent, ignore_errors=True)


def run_bench(tree: Path, bench: str, args: Sequence[str], timeout: float) -> dict[str, Any]:
    """`python -m jobfence bench <bench> --json - --no-save ARGS` run in `tree`, its JSON."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "jobfence", "bench", bench, "--json", "-", "--no-save", *args]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise CompareError(f"bench {bench} in {tree} ran past {timeout:.0f} s") from exc
    if done.returncode not in (0, 1):  # 1: a --check target missed, never asked here
        raise CompareError(f"bench {bench} in {tree} exited {done.returncode}: "
                           f"{done.stderr.strip()[-800:]}")  # fmt: skip
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def compare(
    before: Path, after: Path, *, rounds: int, sizes: dict[str, list[str]], timeout: float,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[str, list[float]]]:  # fmt: skip
    """Per side ("before", "after"), per metric name: one value per round, run ABAB."""
    values: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for i in range(rounds):
        for side, tree in (("before", before), ("after", after)):
            for bench in ("gate", "celery"):
                progress(f"round {i + 1}/{rounds}: {bench} {side}")
                report = run_bench(tree, bench, sizes[bench], timeout)
                for m in METRICS:
                    if m.bench == bench:
                        values[side].setdefault(m.name, []).append(m.read(report))
    return values


def table(values: dict[str, dict[str, list[float]]], *, tolerance: float = 5.0) -> str:
    """Per metric: before median, after median, change %; `worse` past `tolerance` %."""
    lines = [f"{'metric':<36} {'before':>10} {'after':>10} {'change':>8}",
             "-" * 67]  # fmt: skip
    for m in METRICS:
        b = statistics.median(values["before"][m.name])
        a = statistics.median(values["after"][m.name])
        change = (a - b) / b * 100 if b else 0.0
        worse = -change if m.higher_is_better else change
        mark = "  worse" if worse > tolerance else ("  better" if worse < -tolerance else "")
        lines.append(f"{m.bench + ': ' + m.name:<36} {b:>10.3f} {a:>10.3f} {change:>+7.1f}%{mark}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m devstack.bench.compare",
        description="The gate and Celery benchmarks on --before and on this tree, alternately.",
    )
    p.add_argument("--before", required=True, help="the revision to compare with (e.g. 31329d2)")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds (default 3)")
    p.add_argument("--full", action="store_true",
                   help="the benches' own default sizes (minutes per round) instead of --quick")
    p.add_argument("--quick", action="store_true", help="small sizes, the default")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one bench run may take")
    p.add_argument("--json", metavar="PATH", help="also write every round's values to PATH")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.full and args.quick:
        p.error("--full and --quick exclude each other; give one")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = FULL if args.full else QUICK
    try:
        with before_tree(args.before) as before:
            values = compare(before, HERE, rounds=args.rounds, sizes=sizes, timeout=args.timeout,
                             progress=lambda s: print(s, file=sys.stderr, flush=True))  # fmt: skip
    except CompareError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    print(f"before {args.before}, after {HERE} (working tree); {args.rounds} rounds ABAB, "
          f"medians; {os.cpu_count()} cores")  # fmt: skip
    print(table(values))
    if args.json:
        Path(args.json).write_text(json.dumps({"before": args.before, "values": values}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
