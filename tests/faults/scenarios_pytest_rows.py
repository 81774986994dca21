"""Fault rows a, b and g in the fault report: their tests, run as they are, judged by outcome.

Those rows are pytest tests with fixtures of their own (a reply-dropping proxy, network
namespaces, a libfaketime-stepped server); the report runs them in a pytest subprocess, so
nothing is copied. The naive side runs the row's ``control`` tests (each asserts that the
naive task breaks: its passing is the breakage); the jobfence side runs the others. A row
whose test file is absent is left out of the table; skipped tests are named with their reason.
These rows count no jobs: the cell says how many of the row's tests showed what.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from devstack.faults_report import Outcome, Scenario, Side

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 900.0


@dataclass(frozen=True)
class Junit:
    tests: int
    failures: int
    skipped: int
    skip_reason: str

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.skipped


def _run_pytest(path: str, select: str, workdir: Path) -> Junit:
    xml = workdir / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, "-k", select,
         f"--junitxml={xml}", f"--basetemp={workdir / 'tmp'}"],
        cwd=REPO_ROOT, capture_output=True, timeout=TIMEOUT, check=False,
    )  # fmt: skip
    if not xml.exists():
        raise RuntimeError(f"pytest wrote no report for {path} -k {select!r}")
    tests = failures = skipped = 0
    reason = ""
    for case in ET.parse(xml).getroot().iter("testcase"):
        tests += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failures += 1
        skip = case.find("skipped")
        if skip is not None:
            skipped += 1
            reason = reason or (skip.get("message") or "")[:120]
    return Junit(tests, failures, skipped, reason)


def _row(path: str) -> Callable[[Side, Path, bool], Outcome]:
    def run(side: Side, workdir: Path, full: bool) -> Outcome:
        if side == "naive":
            got = _run_pytest(path, "control", workdir)
            return Outcome(
                jobs=0,
                double=0,
                lost=0,
                detail=_say(got, "control tests showed the breakage"),
                broken=got.passed > 0 and got.failures == 0,
            )
        got = _run_pytest(path, "not control", workdir)
        return Outcome(
            jobs=0,
            double=0,
            lost=0,
            detail=_say(got, "jobfence tests passed"),
            broken=got.failures > 0 or got.passed == 0,
        )

    return run


def _say(got: Junit, what: str) -> str:
    text = f"{got.passed}/{got.tests} {what}"
    if got.skipped:
        text += f", {got.skipped} skipped ({got.skip_reason})"
    return text


ROWS = {
    "a": ("the acquire reply lost after the server ran it (TCP proxy)",
          "tests/faults/test_lost_acquire_reply.py"),
    "b": ("a worker partitioned from the lock server (netns, nftables)",
          "tests/faults/test_partition.py"),
    "g": ("the lock server's clock stepped forward and back (libfaketime)",
          "tests/faults/test_clock_step.py"),
}  # fmt: skip

SCENARIOS = [
    Scenario(row, fault, _row(path))
    for row, (fault, path) in ROWS.items()
    if (REPO_ROOT / path).exists()
]
