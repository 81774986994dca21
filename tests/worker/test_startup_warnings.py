"""Start-up checks that help: unknown JOBFENCE_* variables (check, a real worker), bad URLs."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
from celery import Celery

from jobfence.config import Settings
from jobfence.config.errors import EX_CONFIG
from jobfence.tasks import install
from jobfence.worker.checks import StartupWarning, check_broker, check_environment, enforce
from jobfence.worker.server_checks import same_server
from tests.servers import RedisServer
from tests.worker.test_cli import REPO_ROOT

TYPO = "JOBFENCE_DEFAULT_TLL"
SUGGESTION = "did you mean JOBFENCE_DEFAULT_TTL?"
VALUE = "value-never-shown-41"


def _without_jobfence_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("JOBFENCE_")}


def test_check_environment_warns_with_the_closest_name_and_no_value() -> None:
    (finding,) = check_environment({TYPO: VALUE, "JOBFENCE_DEMO_SEED": "x", "HOME": "/"})
    assert not finding.refuse
    assert finding.setting == TYPO
    assert SUGGESTION in str(finding) and VALUE not in str(finding)


def test_enforce_warns_about_an_unknown_variable(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    for name in list(os.environ):
        if name.upper().startswith("JOBFENCE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(TYPO, VALUE)
    app = Celery("startup-warnings", set_as_current=False)
    app.conf.update(accept_content=["json"], task_acks_late=True, task_reject_on_worker_lost=True)
    runtime = install(app, Settings(lock_url=redis_url))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            enforce(app, runtime)  # a warning, not a refusal
    finally:
        runtime.close()
    texts = [str(w.message) for w in caught if issubclass(w.category, StartupWarning)]
    assert any(t.startswith(TYPO) and SUGGESTION in t for t in texts), texts


def test_the_check_command_reports_an_unknown_variable(fresh_redis: RedisServer) -> None:
    env = {"JOBFENCE_LOCK_URL": fresh_redis.url, TYPO: VALUE}
    done = subprocess.run(
        [sys.executable, "-m", "jobfence", "check"],
        env={**_without_jobfence_variables(), **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr  # warned, not refused
    assert f"warning: {TYPO}: " in done.stdout and SUGGESTION in done.stdout
    assert VALUE not in done.stdout + done.stderr
    assert "start-up checks: passed" in done.stdout


def test_a_real_worker_warns_at_start_up(fresh_redis: RedisServer) -> None:
    # An evicting lock server makes the worker stop right after its checks: the warning about
    # the typo must be out by then, beside the refusal.
    fresh_redis.client().config_set("maxmemory-policy", "allkeys-lru")
    env = {**_without_jobfence_variables(), "JOBFENCE_LOCK_URL": fresh_redis.url, TYPO: VALUE}
    args = [sys.executable, "-m", "celery", "-A", "demo.app", "worker",
            "--pool", "solo"]  # fmt: skip
    done = subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == EX_CONFIG, output
    assert TYPO in output and SUGGESTION in output, output
    assert VALUE not in output


def test_an_apps_own_broker_url_with_a_bad_port_is_refused_in_one_line(redis_url: str) -> None:
    app = Celery("bad-broker", set_as_current=False)
    app.conf.update(broker_url="redis://:hunter2-pw@127.0.0.1:99999/1")
    runtime = install(app, Settings(lock_url=redis_url))
    try:
        (finding,) = check_broker(app.conf, runtime)
    finally:
        runtime.close()
    assert finding.refuse and finding.setting == "broker_url"
    assert "port 99999" in finding.problem and "redis://127.0.0.1:6379/1" in finding.fix
    assert "hunter2-pw" not in str(finding) and "\n" not in str(finding)


def test_the_check_command_refuses_bad_settings_without_showing_secrets() -> None:
    env = {
        **_without_jobfence_variables(),
        "JOBFENCE_KEY_SECRET": "s3cr3t-Key-Value-0042",
        "JOBFENCE_LOCK_URL": "redis://:hunter2-Pa55@127.0.0.1:99999/0",
        "JOBFENCE_DEFAULT_TTL": "soon",
    }
    done = subprocess.run(
        [sys.executable, "-m", "jobfence", "check"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == EX_CONFIG, output
    assert "JOBFENCE_LOCK_URL" in output and "JOBFENCE_DEFAULT_TTL" in output
    assert "s3cr3t-Key-Value-0042" not in output and "hunter2-Pa55" not in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    "lock_url",
    [
        "etcd://127.0.0.1:2379,127.0.0.1:22379",
        "zookeeper://127.0.0.1:2181,127.0.0.1:2182/jobs",
        "postgresql://jf@127.0.0.1:6379/jobs",
    ],
)
def test_a_lock_server_that_is_not_redis_is_never_taken_for_the_redis_broker(lock_url: str) -> None:
    # A multi-member URL has no single port: urlsplit(...).port raised ValueError before.
    assert not same_server("redis://127.0.0.1:6379/1", lock_url)
