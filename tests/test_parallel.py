"""How the suite splits among xdist workers; which tests the fast tier and other Pythons keep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.parallel import scope_of

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_contract_suite_runs_on_one_worker() -> None:
    for name in (
        "tests/contract/test_lock_contract.py::test_mutual_exclusion_across_racing_processes[etcd]",
        "tests/contract/test_leader_contract.py::test_one_leader[1.5-redlock5]",
        "tests/contract/test_semaphore_contract.py::test_control_overshoots",
    ):
        assert scope_of(name) == "tests/contract"


def test_any_other_test_runs_with_its_file() -> None:
    name = "tests/integration/test_lifetimes.py::test_start_queues[redis]"
    assert scope_of(name) == "tests/integration/test_lifetimes.py"


def test_the_fast_tier_keeps_the_contract_on_memory_and_no_other_backend() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only",
         "-m", "not server", "tests/contract/test_lock_contract.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    kept = [line for line in done.stdout.splitlines() if "::" in line]
    backends = {line[line.index("[") + 1 : -1].split("-")[0] for line in kept if "[" in line}
    assert backends == {"memory"}, backends


def test_the_selection_of_the_other_pythons_names_files_that_exist() -> None:
    """`make test-pythons` runs these on 3.12 and 3.13: a renamed file must not drop out."""
    from tests.conftest import PYTHONS_SELECTION

    missing = [path for path in PYTHONS_SELECTION if not (REPO_ROOT / path).is_file()]
    assert missing == []
    assert "tests/test_django_tasks_path.py" in PYTHONS_SELECTION
