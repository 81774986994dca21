"""`jobfence fleet --app` and `jobfence check --app` with a user's own Celery app."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from demo.fleet import build_parser as fleet_parser
from devstack import procs
from jobfence.config.errors import EX_CONFIG
from jobfence.worker.app import redis_db_url
from jobfence.worker.cli import build_parser
from tests.servers import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]

TASKS_PY = """
import os

from celery import Celery

import jobfence
from jobfence import singleton_task

app = Celery("tasks", broker=os.environ["USER_BROKER_URL"])
if os.environ.get("USER_ACCEPT_PICKLE"):
    app.conf.accept_content = ["pickle", "json"]
if os.environ.get("USER_SETUP"):
    jobfence.setup(app)


@singleton_task(name="tasks.work")
def work(job: int) -> int:
    return job
"""


@pytest.fixture
def project(tmp_path: Path, redis_url: str) -> tuple[Path, dict[str, str]]:
    """A user project with its own tasks.py, and the environment to run it with."""
    root = tmp_path / "userproj"
    root.mkdir()
    (root / "tasks.py").write_text(textwrap.dedent(TASKS_PY))
    # `jobfence fleet` lives beside the demo, in the checkout: on PYTHONPATH from elsewhere.
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "JOBFENCE_LOCK_URL": redis_url,
        "USER_BROKER_URL": redis_db_url(redis_url, 1),
        "PYTHONUNBUFFERED": "1",
    }
    return root, env


def _jobfence(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobfence", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("command", ["fleet", "check"])
def test_the_app_option_is_in_the_help(command, capsys):
    with pytest.raises(SystemExit):  # the fleet's own parser lives beside the demo
        if command == "fleet":
            fleet_parser().parse_args(["--help"])
        else:
            build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert "--app MODULE[:ATTR]" in out
    assert "your Celery app" in out


def test_check_refuses_a_set_up_user_app_that_accepts_pickle(project):
    root, env = project
    done = _jobfence(root, {**env, "USER_SETUP": "1", "USER_ACCEPT_PICKLE": "1"}, "check",
                     "--app", "tasks")  # fmt: skip
    assert done.returncode == EX_CONFIG, done.stdout + done.stderr
    assert "REFUSED: accept_content" in done.stdout
    assert "start-up checks: refused" in done.stdout
    assert "not set up" not in done.stdout


def test_check_passes_a_set_up_user_app(project):
    root, env = project
    done = _jobfence(root, {**env, "USER_SETUP": "1"}, "check", "--app", "tasks:app")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "start-up checks: passed" in done.stdout


def test_check_says_when_the_user_app_is_not_set_up(project):
    root, env = project
    done = _jobfence(root, env, "check", "--app", "tasks")
    assert "tasks is not set up with jobfence.setup(app)" in done.stdout, done.stderr


def test_check_names_an_app_it_cannot_import(project):
    root, env = project
    done = _jobfence(root, env, "check", "--app", "no_such_module:app")
    assert done.returncode == 2
    assert "no module 'no_such_module'" in done.stderr
    assert str(root) in done.stderr


def test_fleet_refuses_a_broker_option_for_a_user_app(project):
    root, env = project
    done = _jobfence(root, env, "fleet", "--app", "tasks", "--broker", "redis://h:1/0")
    assert done.returncode == 2
    assert "publishes to the broker it sets itself" in done.stderr


def test_fleet_runs_real_workers_of_the_user_app(project, tmp_path):
    root, env = project
    log = tmp_path / "fleet.log"
    with open(log, "wb") as out:
        fleet = procs.spawn(
            [sys.executable, "-m", "jobfence", "fleet", "--app", "tasks", "--workers", "1",
             "--concurrency", "1", "--no-beat", "--shutdown-timeout", "60"],
            env={**env, "USER_SETUP": "1"},
            stdout=out,
            cwd=root,
        )  # fmt: skip
    try:
        wait_for(
            lambda: "fleet: ready: 1 workers" in log.read_text(),
            timeout=120,
            interval=0.2,
            message=lambda: log.read_text(),
        )
        text = log.read_text()
        assert "embedded redis-server" not in text  # a user app keeps its own servers
        assert ". tasks.work" in text, text  # the worker lists the user's task
        fleet.send_signal(signal.SIGINT)
        assert fleet.wait(timeout=90) == 0, log.read_text()
    finally:
        if not procs.exited(fleet):
            procs.stop([fleet], timeout=10, group=True)
    assert "fleet: stopped" in log.read_text()


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize(("port", "server"), [(5672, "RabbitMQ"), (5432, "PostgreSQL")])
def test_a_redis_url_answered_by_another_server_is_refused(project, port, server):
    if not _listening(port):
        pytest.skip(f"nothing listens on {port}")
    root, env = project
    env = {**env, "USER_SETUP": "1", "JOBFENCE_LOCK_URL": f"redis://127.0.0.1:{port}/0"}
    done = _jobfence(root, env, "check", "--app", "tasks")
    assert done.returncode == EX_CONFIG, done.stdout + done.stderr
    assert f"REFUSED: JOBFENCE_LOCK_URL: redis://127.0.0.1:{port}/0 answers, but as" in done.stdout
    assert server in done.stdout and "starting anyway" not in done.stdout


@pytest.mark.parametrize(
    ("url", "server"),
    [
        ("postgresql://127.0.0.1:6379/x", "Redis"),
        ("postgresql://127.0.0.1:5672/x", "RabbitMQ"),
        ("postgresql://127.0.0.1:3306/x", "MySQL/MariaDB"),
        ("mysql://root@127.0.0.1:6379/x", "Redis"),
        ("mysql://root@127.0.0.1:5432/x", "PostgreSQL"),
    ],
)
def test_a_sql_url_answered_by_another_server_is_refused(project, url, server):
    """The reverse of the above (issue 31, item 8): refused at once, where it used to warn
    "cannot reach the lock database ... starting anyway" after the connect timeout."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    if not _listening(port):
        pytest.skip(f"nothing listens on {port}")
    root, env = project
    env = {**env, "USER_SETUP": "1", "JOBFENCE_LOCK_URL": url}
    done = _jobfence(root, env, "check", "--app", "tasks")
    assert done.returncode == EX_CONFIG, done.stdout + done.stderr
    assert f"REFUSED: JOBFENCE_LOCK_URL: {url} answers, but as" in done.stdout, done.stdout
    assert server in done.stdout and "starting anyway" not in done.stdout


@pytest.mark.parametrize("scheme", ["postgresql", "mysql"])
def test_control_a_sql_url_where_nothing_listens_is_an_outage_not_a_refusal(project, scheme):
    from devstack.redis_server import free_port

    root, env = project
    url = f"{scheme}://root@127.0.0.1:{free_port()}/x"
    env = {**env, "USER_SETUP": "1", "JOBFENCE_LOCK_URL": url}
    done = _jobfence(root, env, "check", "--app", "tasks")
    assert "starting anyway" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0


def test_control_a_redis_url_where_nothing_listens_is_an_outage_not_a_refusal(project):
    from devstack.redis_server import free_port

    root, env = project
    env = {**env, "USER_SETUP": "1", "JOBFENCE_LOCK_URL": f"redis://127.0.0.1:{free_port()}/0"}
    done = _jobfence(root, env, "check", "--app", "tasks")
    assert "starting anyway" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0


def test_a_missing_extra_is_named_first(project, tmp_path):
    root, env = project
    blocker = tmp_path / "no_pymysql" / "pymysql"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pymysql'\", name='pymysql')\n"
    )
    path = os.pathsep.join([str(blocker.parent), env.get("PYTHONPATH", "")])
    env = {**env, "USER_SETUP": "1", "PYTHONPATH": path,
           "JOBFENCE_LOCK_URL": "mysql://root@127.0.0.1:3306/jobfence"}  # fmt: skip
    done = _jobfence(root, env, "check", "--app", "tasks")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "pip install 'jobfence[mysql]'" in out
    assert "no Celery app found there" not in out


def test_check_says_which_app_and_server_and_what_it_checked(project):
    root, env = project
    done = _jobfence(root, {**env, "USER_SETUP": "1"}, "check", "--app", "tasks")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "app: tasks" in done.stdout
    assert "(from the environment (JOBFENCE_LOCK_URL)" in done.stdout
    assert "checked:\n  serialisers:" in done.stdout and "  lock server:" in done.stdout
