"""jobfence installed from its wheel into a fresh venv, used by a project laid out as users do.

The project has its own `tasks.py` (the Celery app, as in Celery's tutorial), its own
`config/` package (as in cookiecutter-django), `worker.py` and `locks.py`: every generic
name jobfence's repository folders have. It runs a real `celery worker` from that venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from jobfence.worker.app import redis_db_url
from tests.servers import ProcessGroup, RedisServer, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO_ROOT = Path(__file__).resolve().parents[1]
EX_CONFIG = 78
JOBS, COPIES = 20, 10  # the storm: every job published COPIES times, shuffled
SOURCE_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "tests"
)

PROJECT = {
    "config/__init__.py": '''
        """The project's own settings package (cookiecutter-django calls it config too)."""

        from config.settings import BROKER_URL, COUNTER_URL, RESULT_BACKEND

        __all__ = ["BROKER_URL", "COUNTER_URL", "RESULT_BACKEND"]
    ''',
    "config/settings.py": '''
        import os

        BROKER_URL = os.environ["PROJECT_BROKER_URL"]
        RESULT_BACKEND = os.environ["PROJECT_RESULT_BACKEND"]
        COUNTER_URL = os.environ["PROJECT_COUNTER_URL"]
    ''',
    "locks.py": '''
        """The project's own helpers, in a module named like jobfence's locks package."""

        import redis

        import config


        def count_execution(kind: str, job: int) -> None:
            client = redis.Redis.from_url(config.COUNTER_URL)
            try:
                client.hincrby(f"executions:{kind}", str(job), 1)
            finally:
                client.close()
    ''',
    "tasks.py": '''
        """The Celery app, as in Celery's tutorial. No jobfence.setup, no install: the
        decorator alone, with jobfence's settings from JOBFENCE_* variables."""

        import time

        from celery import Celery

        import config
        import locks
        from jobfence import singleton_task

        app = Celery("tasks", broker=config.BROKER_URL, backend=config.RESULT_BACKEND)


        @singleton_task(app=app)
        def fenced(job: int) -> int:
            locks.count_execution("fenced", job)
            time.sleep(0.05)
            return job


        @app.task
        def plain(job: int) -> int:
            locks.count_execution("plain", job)
            time.sleep(0.05)
            return job
    ''',
    "worker.py": '''
        """Starts this project's worker: python worker.py"""

        from tasks import app

        if __name__ == "__main__":
            app.worker_main(["worker", "--pool", "prefork", "--concurrency", "4",
                             "--loglevel", "INFO", "--without-gossip", "--without-mingle"])
    ''',
    "publish.py": '''
        """Publishes a storm: every job COPIES times, shuffled; waits for every result."""

        import json
        import random
        import sys

        import tasks
        from jobfence import DuplicateSkipped


        def result(r):
            try:
                return r.get(timeout=240)
            except DuplicateSkipped as exc:  # skipped beside a running copy: that one answers
                return tasks.app.AsyncResult(exc.task_id).get(timeout=240)


        task = getattr(tasks, sys.argv[1])
        jobs, copies = int(sys.argv[2]), int(sys.argv[3])
        order = [job for job in range(jobs) for _ in range(copies)]
        random.Random(7).shuffle(order)
        results = [task.delay(job) for job in order]
        print(json.dumps([result(r) for r in results]))
    ''',
    "setup_tasks.py": '''
        """A user app set up with jobfence.setup(app) (PROJECT_NO_SETUP: without it)."""

        import os

        from celery import Celery

        import config
        import jobfence

        app = Celery("setup_tasks", broker=config.BROKER_URL, backend=config.RESULT_BACKEND)
        if os.environ.get("PROJECT_ACCEPT_PICKLE"):
            app.conf.accept_content = ["pickle", "json"]
        if not os.environ.get("PROJECT_NO_SETUP"):
            jobfence.setup(app)


        @jobfence.singleton_task(app=app)
        def job(n: int) -> int:
            return n
    ''',
}


# --------------------------------------------------------------------------- fixtures


def _run(
    args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with jobfence installed from its wheel (not editable), deps from the index."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO_ROOT, source, symlinks=True, ignore=SOURCE_IGNORE)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "dist"),
          str(source)], cwd=root)  # fmt: skip
    (wheel,) = (root / "dist").glob("jobfence-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
          "--disable-pip-version-check",
          str(wheel)], cwd=root)  # fmt: skip
    return venv


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """The project's broker, result backend, counters and (unless a test says) lock server."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def project(tmp_path: Path, server: RedisServer) -> Path:
    """The user project, freshly written; the server emptied."""
    client = server.client()
    try:
        client.flushall()
    finally:
        client.close()
    root = tmp_path / "project"
    for name, text in PROJECT.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def project_env(server: RedisServer, lock_url: str | None = None, **extra: str) -> dict[str, str]:
    """The environment the project runs with: only the venv's own packages on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({
        "JOBFENCE_LOCK_URL": lock_url or redis_db_url(server.url, 0),
        "JOBFENCE_KEY_SECRET": "a-secret-of-the-project-under-test",
        "PROJECT_BROKER_URL": redis_db_url(server.url, 1),
        "PROJECT_RESULT_BACKEND": redis_db_url(server.url, 2),
        "PROJECT_COUNTER_URL": redis_db_url(server.url, 3),
        "PYTHONUNBUFFERED": "1",
        # Celery itself refuses pickle under root; this lets jobfence's refusal be the one seen.
        "C_FORCE_ROOT": "1",
        **extra,
    })  # fmt: skip
    return env


def executions(server: RedisServer, kind: str) -> dict[int, int]:
    client = redis.Redis.from_url(redis_db_url(server.url, 3), decode_responses=True)
    try:
        return {int(k): int(v) for k, v in client.hgetall(f"executions:{kind}").items()}
    finally:
        client.close()


def start_worker(
    group: ProcessGroup, args: list[str], root: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    proc = group.spawn(args, env=env, cwd=root, name="user-worker")
    wait_for(
        lambda: "ready." in group.log_of(proc, 400) or proc.poll() is not None,
        timeout=120,
        interval=0.2,
    )
    assert proc.poll() is None, group.log_of(proc)
    return proc


# --------------------------------------------------------------------------- the tests


def test_a_clean_install_can_talk_to_a_redis_broker(clean_venv: Path, tmp_path: Path) -> None:
    # kombu's Redis transport imports `packaging` without declaring it.
    done = subprocess.run(
        [str(clean_venv / "bin" / "python"), "-c", "import kombu.transport.redis, jobfence"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_the_wheel_installs_only_the_jobfence_namespace(clean_venv: Path) -> None:
    (site,) = (clean_venv / "lib").glob("python3*/site-packages")
    for generic in ("tasks", "config", "locks", "worker", "bench"):
        assert not (site / generic).exists(), f"the wheel installs a top-level {generic}/"
    assert (site / "jobfence" / "worker" / "setup.py").exists()


@pytest.fixture
def storm_worker(
    clean_venv: Path, project: Path, server: RedisServer, process_group: ProcessGroup
) -> Path:
    """`python worker.py` of the project, prefork, ready."""
    start_worker(process_group, [str(clean_venv / "bin" / "python"), "worker.py"], project,
                 project_env(server))  # fmt: skip
    return project


def publish_storm(venv: Path, root: Path, server: RedisServer, task: str) -> list[object]:
    done = _run(
        [str(venv / "bin" / "python"), "publish.py", task, str(JOBS), str(COPIES)],
        cwd=root,
        env=project_env(server),
    )
    results: list[object] = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == JOBS * COPIES
    assert Counter(results) == {job: COPIES for job in range(JOBS)}  # every copy answered
    return results


def test_singleton_task_alone_runs_each_job_of_a_storm_once(
    clean_venv: Path, storm_worker: Path, server: RedisServer
) -> None:
    publish_storm(clean_venv, storm_worker, server, "fenced")
    assert executions(server, "fenced") == {job: 1 for job in range(JOBS)}


def test_control_a_plain_task_runs_every_duplicate_of_the_storm(
    clean_venv: Path, storm_worker: Path, server: RedisServer
) -> None:
    publish_storm(clean_venv, storm_worker, server, "plain")
    assert executions(server, "plain") == {job: COPIES for job in range(JOBS)}


# -- jobfence.setup(app) refuses unsafe settings at worker start, with a control ----------


def _celery(venv: Path, program: str = "worker") -> list[str]:
    args = [str(venv / "bin" / "celery"), "-A", "setup_tasks", program, "--loglevel", "INFO"]
    if program == "worker":
        args += ["--pool", "solo", "--without-gossip", "--without-mingle"]
    return args


def _refused(venv: Path, root: Path, env: dict[str, str], program: str = "worker") -> str:
    done = subprocess.run(
        _celery(venv, program), cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode == EX_CONFIG, output
    assert f"jobfence: refusing to start the {program}: unsafe settings" in output
    assert "ready." not in output
    return output


def test_a_set_up_app_accepting_pickle_refuses_to_start(
    clean_venv: Path, project: Path, server: RedisServer
) -> None:
    output = _refused(clean_venv, project, project_env(server, PROJECT_ACCEPT_PICKLE="1"))
    assert "accept_content" in output
    assert "['pickle']" in output


@pytest.mark.parametrize("program", ["worker", "beat"])
def test_a_set_up_app_on_an_evicting_lock_server_refuses_to_start(
    clean_venv: Path, project: Path, server: RedisServer, fresh_redis: RedisServer, program: str
) -> None:
    fresh_redis.client().config_set("maxmemory-policy", "allkeys-lru")
    env = project_env(server, lock_url=fresh_redis.url)
    output = _refused(clean_venv, project, env, program)
    assert "JOBFENCE_LOCK_URL" in output
    assert "maxmemory-policy 'allkeys-lru'" in output


def test_control_without_setup_the_same_unsafe_worker_starts(
    clean_venv: Path,
    project: Path,
    server: RedisServer,
    fresh_redis: RedisServer,
    process_group: ProcessGroup,
) -> None:
    fresh_redis.client().config_set("maxmemory-policy", "allkeys-lru")
    env = project_env(
        server, lock_url=fresh_redis.url, PROJECT_ACCEPT_PICKLE="1", PROJECT_NO_SETUP="1"
    )
    worker = start_worker(process_group, _celery(clean_venv), project, env)
    assert "refusing to start" not in process_group.log_of(worker, 400)
