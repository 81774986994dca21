"""A user's Django project set up as the README says (tests/django_example), run for real.

The project is copied to a temporary directory and run from there, as a user runs theirs:
``manage.py`` on a scratch PostgreSQL database, a private redis-server as the lock server,
``celery -A proj worker`` and ``python -m jobfence``. A test that needs a bad setting
appends it to the copy's settings.py, as a user would edit it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase, RedisServer

pytest.importorskip("django")
pytestmark = [pytest.mark.integration]

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "tests" / "django_example"
EX_CONFIG = 78
TTL_REFUSAL = (
    "JOBFENCE_DEFAULT_TTL: the lease TTL 4000s is not shorter than the broker's visibility "
    "timeout 3600s"
)


@dataclass
class Project:
    root: Path
    env: dict[str, str]
    lock_url: str

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args], cwd=self.root, env=self.env, capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip

    def manage(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("manage.py", *args)

    def jobfence(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "jobfence", *args], cwd=self.root, env=env or self.env,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    def add_setting(self, line: str) -> None:
        with (self.root / "proj" / "settings.py").open("a") as f:
            f.write(f"\n{line}\n")


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str, str]]:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    with PostgresDatabase() as db, RedisServer() as redis_server:
        yield db.name, redis_server.url, redis_server.db_url(2)


@pytest.fixture
def project(servers: tuple[str, str, str], tmp_path: Path) -> Project:
    db_name, redis_url, lock_url = servers
    root = tmp_path / "mysite"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JOBFENCE_", "CELERY_", "DJANGO_"))}  # fmt: skip
    env.update({
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]),
        "PROJ_DB_NAME": db_name,
        "PROJ_BROKER_URL": redis_url,
        "PROJ_LOCK_URL": lock_url,
        "JOBFENCE_KEY_SECRET": "django-setup-test-secret-0123456789",
        "JOBFENCE_KEY_SECRET_RESET": "true",
    })  # fmt: skip
    return Project(root, env, lock_url)


def test_the_example_project_passes_check_and_migrates(project: Project) -> None:
    done = project.manage("check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout
    migrated = project.manage("migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stderr


def test_check_refuses_a_ttl_the_worker_refuses_with_the_same_message(project: Project) -> None:
    project.add_setting("JOBFENCE_DEFAULT_TTL = 4000")
    check = project.manage("check")
    assert check.returncode != 0, check.stdout + check.stderr
    assert f"(jobfence.E002) {TTL_REFUSAL}" in check.stderr

    worker = project.run("-m", "celery", "-A", "proj", "worker", "--pool", "solo",
                         "--loglevel", "WARNING", timeout=90)  # fmt: skip
    assert worker.returncode == EX_CONFIG, worker.stdout + worker.stderr
    assert "refusing to start the worker" in worker.stderr
    assert TTL_REFUSAL in worker.stderr


def test_migrate_works_with_a_ttl_the_worker_refuses(project: Project) -> None:
    project.add_setting("JOBFENCE_DEFAULT_TTL = 4000")
    migrated = project.manage("migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stderr
    assert f"(jobfence.W002) {TTL_REFUSAL}" in migrated.stderr  # shown, not fatal


def test_an_invalid_value_breaks_no_command_but_check_and_the_worker(project: Project) -> None:
    project.add_setting("JOBFENCE_DEFAULT_TTL = -1")
    refused = "JOBFENCE_DEFAULT_TTL: must be > 0, got -1.0"
    migrated = project.manage("migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stderr
    shown = project.manage("showmigrations", "jobfence")
    assert shown.returncode == 0 and "0001_initial" in shown.stdout, shown.stderr

    check = project.manage("check")
    assert check.returncode != 0 and f"(jobfence.E001) {refused}" in check.stderr, check.stderr
    worker = project.run("-m", "celery", "-A", "proj", "worker", "--pool", "solo", timeout=90)
    assert worker.returncode == EX_CONFIG, worker.stdout + worker.stderr
    assert refused in worker.stderr


def test_a_typo_in_settings_py_gets_did_you_mean(project: Project) -> None:
    project.add_setting("JOBFENCE_DEFAULT_TLL = 10")
    check = project.manage("check")
    assert check.returncode == 0, check.stderr  # a warning: the default stays in force
    assert "JOBFENCE_DEFAULT_TLL (in Django settings): is not a jobfence setting" in check.stderr
    assert "HINT: did you mean JOBFENCE_DEFAULT_TTL?" in check.stderr
    assert "known names" not in check.stderr
    cli = project.jobfence("check", "--app", "proj")
    assert "did you mean JOBFENCE_DEFAULT_TTL?" in cli.stdout, cli.stdout + cli.stderr


def test_a_missing_migrate_is_named_with_its_fix(project: Project) -> None:
    with PostgresDatabase() as fresh:  # no jobfence tables yet
        project.env["PROJ_DB_NAME"] = fresh.name
        _charge_without_jobfences_tables(project)


def _charge_without_jobfences_tables(project: Project) -> None:
    migrated = project.manage("migrate", "billing", "--noinput")  # not jobfence's tables
    assert migrated.returncode == 0, migrated.stderr
    call = project.manage("shell", "-c", "from billing.tasks import charge; charge('p-1', 100)")
    assert call.returncode != 0
    assert "NotMigrated" in call.stderr
    assert "run `python manage.py migrate jobfence`" in call.stderr
    assert "jobfence_fences" in call.stderr


def test_locks_list_with_app_reads_the_projects_lock_server(project: Project) -> None:
    hold = (
        "import proj; from jobfence import Locker; from jobfence.tasks import runtime_for;"
        "rt = runtime_for(proj.celery_app);"
        "Locker(rt.backend, ttl=300).acquire('nightly-report');"
        "print(rt.settings.lock_url)"
    )
    held = project.manage("shell", "-c", hold)
    assert held.returncode == 0, held.stderr
    assert held.stdout.strip().endswith(project.lock_url)

    listed = project.jobfence("locks", "list", "--app", "proj")
    assert listed.returncode == 0, listed.stderr
    assert f"lock server: {project.lock_url} (from Django settings proj.settings" in listed.stdout
    assert "nightly-report" in listed.stdout

    plain = project.jobfence("locks", "list")  # no --app, no DJANGO_SETTINGS_MODULE
    assert "lock server: redis://127.0.0.1:6379/0 (from the default" in plain.stdout
    assert "no DJANGO_SETTINGS_MODULE" in plain.stdout
    assert "nightly-report" not in plain.stdout

    by_env = project.jobfence("locks", "list",
                              env={**project.env, "DJANGO_SETTINGS_MODULE": "proj.settings"})
    assert "nightly-report" in by_env.stdout, by_env.stdout + by_env.stderr
