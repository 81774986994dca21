"""The fault report's table and verdicts (`python -m jobfence faults`), on made-up outcomes."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack import faults_report
from devstack.faults_report import Outcome, RowResult, Scenario, Side, render, run_row


def _fixed(naive: Outcome, jobfence: Outcome) -> Scenario:
    def run(side: Side, workdir: Path, full: bool) -> Outcome:
        return naive if side == "naive" else jobfence

    return Scenario("z", "a made-up fault", run)


def test_the_rows_c_d_e_f_h_are_found_by_the_report() -> None:
    rows = {s.row for s in faults_report.discover()}
    assert {"c", "d", "e", "f", "h"} <= rows


def test_a_row_where_naive_breaks_and_jobfence_holds_passes(tmp_path: Path) -> None:
    scenario = _fixed(Outcome(10, 3, 1), Outcome(10, 0, 0))
    result = run_row(scenario, tmp_path, full=False, say=lambda _: None)
    assert not result.failed
    table = render([result])
    assert "3 double / 1 lost of 10" in table and "0 double / 0 lost of 10" in table
    assert "holds; naive breaks" in table
    assert table.endswith("PASS: jobfence held in every row that ran")


def test_a_row_where_jobfence_breaks_fails_the_report(tmp_path: Path) -> None:
    scenario = _fixed(Outcome(10, 3, 0), Outcome(10, 0, 2))
    result = run_row(scenario, tmp_path, full=False, say=lambda _: None)
    assert result.failed
    assert "FAIL: jobfence broke in rows z" in render([result])


def test_a_control_that_did_not_bite_is_said_so_and_an_error_is_a_failure(tmp_path: Path) -> None:
    quiet = run_row(_fixed(Outcome(5, 0, 0), Outcome(5, 0, 0)), tmp_path, full=False,
                    say=lambda _: None)
    assert quiet.verdict == "holds (control did not bite this time)" and not quiet.failed

    def boom(side: Side, workdir: Path, full: bool) -> Outcome:
        raise RuntimeError("no redis-server")

    errored = run_row(Scenario("y", "boom", boom), tmp_path, full=False, say=lambda _: None)
    assert errored.failed and "no redis-server" in errored.verdict


def test_an_unavailable_row_is_skipped_with_its_reason(tmp_path: Path) -> None:
    scenario = Scenario("x", "needs root", _fixed(Outcome(1, 0, 0), Outcome(1, 0, 0)).run,
                        lambda: "not root")
    result: RowResult = run_row(scenario, tmp_path, full=False, say=lambda _: None)
    assert result.skipped == "not root" and not result.failed


def test_unknown_rows_are_refused_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert faults_report.main(["--rows", "zz"]) == 2
    assert "unknown rows ['zz']" in capsys.readouterr().err
