"""The flows tell, the middleware observe: no flow logs or counts, and the event table is whole."""

from __future__ import annotations

import ast
import logging
import pathlib
import string
from typing import Any

import pytest

from jobfence.locks import Backoff, LeaseKeeper, MemoryBackend
from jobfence.locks.decisions import Decision
from jobfence.tasks.decisions import describe
from jobfence.tasks.events import PHRASES, TABLE, Event, Kind, Row, fields
from jobfence.tasks.executor import Executor
from jobfence.tasks.lifecycle import JobSpec
from jobfence.tasks.middleware import Delivery, Middleware
from tests.tasks.conftest import spec_for, unique

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: The job flow's phase files (tasks/flow/), and the other I/O-free flows.
FLOW_PHASES = ("spec", "marks", "ops", "ending", "settle", "claim", "rotation", "gate",
               "admission", "body", "verdict", "job")  # fmt: skip
#: The I/O-free flows: they yield ops and events, and never log or count.
FLOW_MODULES = (
    *(f"tasks/flow/{name}.py" for name in FLOW_PHASES),
    "tasks/lifecycle.py",
    "tasks/publish.py",
    "locks/flows.py",
)
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log",
               "getLogger"}  # fmt: skip
METRIC_METHODS = {"inc", "dec", "observe", "labels", "set"}
#: Modules whose import means logging or counting.
OBSERVING_IMPORTS = {"logging", "prometheus_client", "jobfence.tasks.metrics",
                     "jobfence.locks.outage"}  # fmt: skip


def _root(node: ast.expr) -> str:
    """The name an attribute chain starts from (`self.metrics.x.inc` -> `self.metrics`)."""
    parts = []
    while isinstance(node, ast.Attribute | ast.Call):
        if isinstance(node, ast.Call):  # through a call: `metrics.labels(...).inc`
            node = node.func
            continue
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def observing_calls(source: str, name: str = "<flow>") -> list[str]:
    """Where `source` logs or counts: a logger's or the outage limiter's method called, a
    metric updated, `metrics` reached, or a logging or metrics module imported (one entry
    per line)."""
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            if any(n in OBSERVING_IMPORTS for n in names):
                found.setdefault(node.lineno, f"{node.lineno}: import {', '.join(map(str, names))}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        chain, method = _root(node.func), node.func.attr
        receiver = chain.rsplit(".", 1)[0].lower()
        logs = method in LOG_METHODS and ("log" in receiver or "outage" in receiver)
        counts = method in METRIC_METHODS or "metrics" in chain.lower()
        if logs or counts:
            found.setdefault(node.lineno, f"{node.lineno}: {chain}()")
    return [found[line] for line in sorted(found)]


@pytest.mark.parametrize("module", FLOW_MODULES)
def test_no_flow_logs_or_counts(module: str) -> None:
    path = ROOT / module
    found = observing_calls(path.read_text(), module)
    assert not found, f"{module} logs or counts (yield an Event instead):\n" + "\n".join(found)


def test_every_phase_file_is_scanned() -> None:
    on_disk = {path.stem for path in (ROOT / "tasks" / "flow").glob("*.py")} - {"__init__"}
    assert on_disk == set(FLOW_PHASES)


def test_control_the_scan_finds_the_calls_the_flow_made_before_its_events() -> None:
    """Lines of tasks/lifecycle.py before the events table (issue 32, item 2)."""
    before = '''
import logging
from jobfence.locks.outage import OUTAGE
log = logging.getLogger("jobfence.tasks.executor")
def replay(self, record):
    self.metrics.replays.labels(spec.name).inc()
    self.metrics.task(spec.name).acquire_wait.observe((yield Now()) - started)
    self.metrics.rate_limit_denied(rate.label, "late")
    log.info("job %s task %s superseded by task %s", spec.key, spec.task_id, holder)
    log.error("job %s %s", spec.key, message)
    OUTAGE.warning(log, "lock server unavailable before job %s ran: %s", spec.key, name)
    yield Note("replayed", record.fence)
'''
    found = observing_calls(before)
    assert len(found) == 9, found
    assert not any("Note" in line for line in found)  # telling is not logging


def test_every_kind_has_its_row_and_every_line_formats() -> None:
    assert set(TABLE) == set(Kind)
    spec = spec_for("tests.job:k")
    for kind, row in TABLE.items():
        assert bool(row.level) == bool(row.line), kind
        if row.line:  # every %(name)s it uses is a field (a KeyError here is a broken line)
            assert row.line % fields(spec, Event(kind, 7, detail="X")), kind


def test_every_decision_has_its_words() -> None:
    decisions = {row.decision for row in TABLE.values() if row.decision is not None}
    assert decisions == set(PHRASES)
    for name in decisions:
        words = describe(Decision(0.0, name, "k", "tests.job", "t1", fence=7))
        assert words and "{" not in words, name
    for phrase in PHRASES.values():  # the names a phrase may use, and no other
        used = {f for _, f, _, _ in string.Formatter().parse(phrase) if f}
        assert used <= {"holder", "held", "fence", "f", "newer", "reason"}, phrase


class Seen(Middleware):
    """A new observer is one class: it keeps each decision's name and each delivery's end."""

    routine = True

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.events: list[str] = []
        self.ended: list[JobSpec] = []

    def on_event(self, delivery: Delivery, event: Event, row: Row) -> None:
        self.events.append(event.kind)
        if self.fail:
            raise RuntimeError("an observer's bug")

    def after_delivery(self, delivery: Delivery) -> None:
        self.ended.append(delivery.spec)


@pytest.mark.parametrize("fail", [False, True], ids=["control", "failing"])
def test_a_middleware_sees_a_run_and_never_changes_its_fate(
    fail: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Control: the same run with a middleware that does not raise."""
    seen = Seen(fail)
    keeper = LeaseKeeper()
    executor = Executor(MemoryBackend(), keeper, backoff=Backoff(0.001, 0.01), middleware=[seen])
    spec = spec_for(unique("tests.job:k"))
    calls: list[Any] = []
    try:
        with caplog.at_level(logging.ERROR, logger="jobfence.tasks.executor"):
            out = executor.run(spec, calls.append)
            again = executor.run(spec, calls.append)
    finally:
        keeper.stop()
    assert (out.status, again.status, len(calls)) == ("ran", "replayed", 1)
    assert seen.events == ["granted", "started", "done", "ended", "replayed", "ended"]
    assert seen.ended == [spec, spec]
    failures = [r for r in caplog.records if "middleware Seen failed" in r.getMessage()]
    assert len(failures) == (len(seen.events) if fail else 0)
