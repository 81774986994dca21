"""Issue 32's sizes, held: no product module over 400 lines, no phase of the job's flow over
250, at most 25 product functions over 40 lines (tables and parsers among them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("config", "locks", "tasks", "worker")
MODULE_LINES, PHASE_LINES, FUNCTION_LINES, LONG_FUNCTIONS = 400, 250, 40, 25


def _modules() -> list[Path]:
    return sorted(p for folder in PRODUCT for p in (ROOT / folder).rglob("*.py"))


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_product_module_is_over_400_lines() -> None:
    over = {str(p.relative_to(ROOT)): _lines(p) for p in _modules() if _lines(p) > MODULE_LINES}
    assert over == {}


def test_no_phase_of_the_jobs_flow_is_over_250_lines() -> None:
    phases = sorted((ROOT / "tasks" / "flow").glob("*.py"))
    assert len(phases) >= 8
    over = {p.name: _lines(p) for p in phases if _lines(p) > PHASE_LINES}
    assert over == {}


def test_at_most_25_product_functions_are_over_40_lines() -> None:
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({length})")
    assert len(long) <= LONG_FUNCTIONS, long
