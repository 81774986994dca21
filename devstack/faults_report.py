"""`python -m jobfence faults`: every fault scenario against a naive task and jobfence, one table.

The scenarios themselves live beside the fault tests (``tests/faults/scenarios_*.py``, each
with a module-level ``SCENARIOS`` list of :class:`Scenario`), so the report and the suite run
the same code; like the benchmarks, the report runs from the source tree. Each scenario starts
its own servers and real worker fleets, runs its fault once against the naive control and
once against jobfence, and returns an :class:`Outcome` per side. The report exits non-zero if
any jobfence side fails.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

Side = Literal["naive", "jobfence"]
SIDES: tuple[Side, ...] = ("naive", "jobfence")
SCENARIO_PACKAGE = "tests.faults"
SCENARIO_PREFIX = "scenarios_"


@dataclass(frozen=True)
class Outcome:
    """What one side of a scenario did: effects twice, jobs lost, and what else was seen.

    ``broken`` is the scenario's own verdict where double/lost do not say it all (a poison
    message that loops has neither); ``None`` means "broken if anything doubled or was lost".
    """

    jobs: int
    double: int
    lost: int
    detail: str = ""
    broken: bool | None = None

    @property
    def failed(self) -> bool:
        return self.broken if self.broken is not None else bool(self.double or self.lost)

    def cell(self) -> str:
        if not self.jobs:  # a row judged by its tests, not by counted jobs
            return self.detail
        text = f"{self.double} double / {self.lost} lost of {self.jobs}"
        return f"{text}; {self.detail}" if self.detail else text


@dataclass(frozen=True)
class Scenario:
    """One fault row: ``run(side, workdir, full)`` runs it against one side.

    ``full`` asks for the report's size (more jobs, longer storms) instead of the suite's.
    ``unavailable()`` returns why the row cannot run here (not root, a tool missing), or None.
    """

    row: str
    fault: str
    run: Callable[[Side, Path, bool], Outcome]
    unavailable: Callable[[], str | None] = lambda: None


@dataclass(frozen=True)
class RowResult:
    scenario: Scenario
    naive: Outcome | None
    jobfence: Outcome | None
    skipped: str = ""
    error: str = ""
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        if self.skipped:
            return f"skipped: {self.skipped}"
        if self.jobfence is None:
            return f"FAIL (error: {self.error})"
        if self.jobfence.failed:
            return "FAIL: jobfence broke"
        if self.naive is None:
            return f"holds (control errored: {self.error})"
        if not self.naive.failed:
            return "holds (control did not bite this time)"
        return "holds; naive breaks"

    @property
    def failed(self) -> bool:
        return not self.skipped and (self.jobfence is None or self.jobfence.failed)


def discover(package: str = SCENARIO_PACKAGE) -> list[Scenario]:
    """Every ``SCENARIOS`` entry of the ``scenarios_*`` modules of ``package``, by row."""
    pkg = importlib.import_module(package)
    found: list[Scenario] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith(SCENARIO_PREFIX):
            module = importlib.import_module(f"{package}.{info.name}")
            found.extend(getattr(module, "SCENARIOS", []))
    return sorted(found, key=lambda s: s.row)


def run_row(
    scenario: Scenario, workdir: Path, *, full: bool, say: Callable[[str], None]
) -> RowResult:
    """Run both sides of one row; an error on one side is reported, not raised."""
    reason = scenario.unavailable()
    if reason:
        say(f"row {scenario.row}: skipped ({reason})")
        return RowResult(scenario, None, None, skipped=reason)
    started = time.monotonic()
    outcomes: dict[str, Outcome | None] = {}
    errors = []
    for side in SIDES:
        say(f"row {scenario.row} ({scenario.fault}): {side} ...")
        side_dir = workdir / f"row-{scenario.row}-{side}"
        side_dir.mkdir(parents=True, exist_ok=True)
        try:
            outcomes[side] = scenario.run(side, side_dir, full)
            say(f"row {scenario.row}: {side}: {outcomes[side].cell()}")  # type: ignore[union-attr]
        except Exception as exc:
            outcomes[side] = None
            errors.append(f"{side}: {type(exc).__name__}: {str(exc)[:200]}")
            say(f"row {scenario.row}: {side} errored\n{traceback.format_exc(limit=5)}")
    return RowResult(
        scenario,
        outcomes["naive"],
        outcomes["jobfence"],
        error="; ".join(errors),
        seconds=time.monotonic() - started,
    )


def render(results: Sequence[RowResult]) -> str:
    """The table: row, fault, naive, jobfence, verdict."""
    head = ("row", "fault", "naive: effects/lost", "jobfence: effects/lost", "verdict")
    rows = [
        (
            r.scenario.row,
            r.scenario.fault,
            r.naive.cell() if r.naive else "-",
            r.jobfence.cell() if r.jobfence else "-",
            r.verdict,
        )
        for r in results
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    failed = [r.scenario.row for r in results if r.failed]
    out.append("")
    out.append(f"FAIL: jobfence broke in rows {', '.join(failed)}" if failed else
               "PASS: jobfence held in every row that ran")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobfence faults",
        description="Run every fault scenario of tests/faults against a naive task and against "
        "jobfence, each on private servers and real worker fleets, and print one table. Exits "
        "non-zero if jobfence breaks in any row. Run from the repository root.",
    )
    p.add_argument("--rows", default="", help="only these rows, e.g. 'c,e' (default: all)")
    p.add_argument("--quick", action="store_true", help="the suite's small sizes, not the full")
    p.add_argument("--workdir", help="keep fleet logs and ledgers here (default: a temp dir)")
    return p


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = out or sys.stdout

    def say(text: str) -> None:
        print(f"faults: {text}", file=sys.stderr, flush=True)

    try:
        scenarios = discover()
    except ModuleNotFoundError as exc:
        print(
            f"faults: cannot load the scenarios ({exc}); run from the repository root with "
            "pip install -e '.[dev]'",
            file=sys.stderr,
        )
        return 2
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    if wanted:
        unknown = wanted - {s.row for s in scenarios}
        if unknown:
            print(f"faults: unknown rows {sorted(unknown)}; known: "
                  f"{', '.join(s.row for s in scenarios)}", file=sys.stderr)
            return 2
        scenarios = [s for s in scenarios if s.row in wanted]
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="jobfence-faults-"))
    say(f"{len(scenarios)} rows; logs and ledgers under {base}")
    results = [run_row(s, base, full=not args.quick, say=say) for s in scenarios]
    print("", file=out)
    print("jobfence fault report", file=out)
    print("=====================", file=out)
    print(render(results), file=out)
    print(f"  (logs: {base})", file=out)
    return 1 if any(r.failed for r in results) else 0
