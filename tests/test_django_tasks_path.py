"""Which Django tasks framework jobfence runs on, per Python of `make test`: the backport on
3.11 (Django 5.2), Django's own django.tasks on 3.12 (Django 6.0) and 3.13 (Django 6.1), and
the built-in first wherever both could be imported."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "jobfence.tasks.django_tasks", reason="needs django.tasks (Django 6) or the backport"
)

import django

from jobfence.tasks.django_tasks import FRAMEWORK, FencedTask
from tests.djtasks import KEYWORDS

ROOT = Path(__file__).resolve().parent.parent
#: The framework and Django each Python of `make test` installs (pyproject.toml's dev extra).
EXPECTED = {
    (3, 11): ("django_tasks", (5, 2)),
    (3, 12): ("django.tasks", (6, 0)),
    (3, 13): ("django.tasks", (6, 1)),
}


@pytest.mark.skipif(sys.version_info[:2] not in EXPECTED, reason="not a Python of make test")
def test_each_python_of_make_test_runs_its_own_framework_and_django() -> None:
    framework, django_version = EXPECTED[sys.version_info[:2]]
    assert (FRAMEWORK, django.VERSION[:2]) == (framework, django_version)


def test_the_fenced_task_is_a_task_of_the_framework_in_use() -> None:
    base = importlib.import_module(f"{FRAMEWORK}.base")
    assert issubclass(FencedTask, base.Task)
    builtin = django.VERSION >= (6,)
    assert ("django.tasks" if builtin else "django_tasks") == FRAMEWORK


def test_task_passes_the_gate_options_on_the_backport_and_from_django_6_1() -> None:
    """Django 6.0's `task()` takes no extra keywords: `@fenced` carries the options there."""
    passes_keywords = FRAMEWORK == "django_tasks" or django.VERSION >= (6, 1)
    assert passes_keywords == KEYWORDS


@pytest.mark.skipif(django.VERSION < (6,), reason="Django before 6 has no django.tasks")
def test_a_django_with_its_own_framework_never_imports_the_backport(tmp_path: Path) -> None:
    """No backport in the venv of Django 6 (it would shadow nothing, and test nothing)."""
    assert importlib.util.find_spec("django_tasks") is None
    # One planted where the import could reach it: jobfence takes django.tasks first and never
    # runs the backport's code.
    planted = tmp_path / "django_tasks"
    planted.mkdir()
    (planted / "__init__.py").write_text("raise SystemExit('the backport was imported')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-c", "from jobfence.tasks import django_tasks as m; print(m.FRAMEWORK)"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert (out.returncode, out.stdout.strip()) == (0, "django.tasks"), out.stderr
