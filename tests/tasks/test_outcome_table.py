"""The flow's one table from a delivery's outcome to its verdict covers every status, and no
shell or observer decodes an outcome: they match a verdict or read an event's row."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from jobfence.locks.acquire import Backoff
from jobfence.locks.backends.memory import MemoryBackend
from jobfence.locks.keeper import LeaseKeeper
from jobfence.tasks.executor import Executor, Outcome, Status
from jobfence.tasks.flow.job import Job
from jobfence.tasks.flow.spec import Redelivery
from jobfence.tasks.flow.verdict import ComeBack, NotSettled, Stop, Value, Verdict
from tests.tasks.conftest import spec_for, unique

ROOT = Path(__file__).resolve().parents[2]
#: Where a status may be named: the flow that decides, and the types it decides with.
DECIDERS = ("tasks/flow/",)
#: The shells and observers: they match a verdict or read an event's row, never a status.
SHELLS = ("tasks/celery_task.py", "tasks/celery_spec.py", "tasks/celery_publish.py",
          "tasks/django_tasks.py", "tasks/django_carrier.py", "tasks/tracing.py",
          "tasks/middleware.py", "tasks/testing/", "worker/why.py")  # fmt: skip


def verdict_of(out: Outcome, **spec: object) -> Verdict:
    """The verdict the flow comes to for `out`, its events told to an executor's shell."""
    keeper = LeaseKeeper()
    executor = Executor(MemoryBackend(), keeper, backoff=Backoff(0.005, 0.05))
    try:
        job = Job(spec_for(unique("job"), **spec), backoff=executor.backoff,  # type: ignore[arg-type]
                  redelivery=Redelivery())  # fmt: skip
        return executor._drive(job, job.verdict(out), None)
    finally:
        keeper.stop()


@pytest.mark.parametrize("status", get_args(Status))
def test_every_status_comes_to_exactly_one_kind_of_verdict(status: str) -> None:
    # A status added to the flow and not to the verdict's table fails here, not in production.
    out = Outcome(status, {"retry_after": 1.0} if status == "rate_skipped" else None,  # type: ignore[arg-type]
                  countdown=5.0, reason="why")  # fmt: skip
    through_a_broker = verdict_of(out, queues=True)
    assert isinstance(through_a_broker, Value | Stop | ComeBack | NotSettled)
    if status in ("ran", "replayed"):
        assert isinstance(through_a_broker, Value)
    elif status in ("duplicate", "superseded", "dropped", "rate_skipped"):
        assert isinstance(through_a_broker, Stop)
    else:
        assert isinstance(through_a_broker, ComeBack)
        assert through_a_broker.retry == (status == "retry")
    direct = verdict_of(out, queues=False)
    assert isinstance(direct, NotSettled) == (status in ("requeue", "redeliver"))


def test_a_copy_comes_back_with_its_marks_and_a_capped_countdown() -> None:
    out = Outcome("redeliver", countdown=500.0, reason="commit outcome unknown")
    back = verdict_of(out, queues=True, redeliveries=3, countdown_cap=30.0)
    assert isinstance(back, ComeBack) and back.countdown == 30.0
    assert back.marks.redeliveries == 4 and not back.marks.deferred
    deferred = verdict_of(Outcome("defer", countdown=2.0), queues=True)
    assert isinstance(deferred, ComeBack) and deferred.marks.deferred


def _decoded(path: Path) -> list[str]:
    """Each place a module reads an outcome: its type named, or a `.status` read."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jobfence"):
            found += [f"{path.relative_to(ROOT)} imports {a.name}" for a in node.names
                      if a.name in ("Outcome", "Status")]  # fmt: skip
        elif isinstance(node, ast.Attribute) and node.attr == "status":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .status")
    return found


def test_no_shell_or_observer_decodes_an_outcome() -> None:
    files = [p for s in SHELLS
             for p in ((ROOT / s).rglob("*.py") if s.endswith("/") else [ROOT / s])]  # fmt: skip
    assert len(files) > len(SHELLS)  # a package is read file by file
    named = [hit for path in files for hit in _decoded(path)]
    assert named == []


def test_control_the_scan_finds_the_flow_deciding_on_outcomes() -> None:
    assert any(".status" in hit for hit in _decoded(ROOT / "tasks/flow/verdict.py"))
