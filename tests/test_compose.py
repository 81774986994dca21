"""docker-compose.yml: configured through real JOBFENCE_* settings, scalable, health-checked."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobfence.config import Settings
from jobfence.config.settings import ENV_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE = REPO_ROOT / "docker-compose.yml"
JOBFENCE_VARIABLE = re.compile(rf"\b{ENV_PREFIX}[A-Z0-9_]+\b")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]  # type: ignore[no-any-return]


def words(command: Any) -> list[str]:
    """A service command (string or list) as argv."""
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(w) for w in command]


def option(argv: list[str], *names: str) -> str | None:
    """The value of `-A X`, `--app X` or `--app=X` style options."""
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def test_every_jobfence_variable_is_a_settings_field(services):
    fields = {name.upper() for name in Settings.model_fields}
    used = set(JOBFENCE_VARIABLE.findall(COMPOSE.read_text()))
    assert used, "the compose file configures nothing through JOBFENCE_* variables"
    unknown = sorted(v for v in used if v[len(ENV_PREFIX) :] not in fields)
    assert unknown == [], f"not config.Settings fields: {unknown}"


def test_services_are_configured_through_jobfence_variables_only(services):
    for name in ("worker", "beat-a", "beat-b", "flower"):
        env = services[name].get("environment") or {}
        assert env, f"{name} has no environment"
        assert all(key.startswith(ENV_PREFIX) for key in env), (name, sorted(env))


def all_commands(services: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Every command the stack runs: service commands, health checks, the image's CMD."""
    argvs = []
    for service in services.values():
        argvs.append(words(service.get("command")))
        test = (service.get("healthcheck") or {}).get("test") or []
        if test and test[0] == "CMD-SHELL":
            argvs.append(shlex.split(test[1]))
        elif test and test[0] == "CMD":
            argvs.append([str(w) for w in test[1:]])
    cmd = re.search(r"(?m)^CMD\s+(\[.*\])\s*$", (REPO_ROOT / "Dockerfile").read_text())
    assert cmd is not None, "the Dockerfile has no CMD"
    argvs.append(json.loads(cmd[1]))
    return [a for a in argvs if a]


def test_the_apps_and_modules_named_in_commands_exist(services):
    argvs = all_commands(services)
    apps = {option(a, "-A", "--app") for a in argvs} - {None}
    modules = {option(a, "-m") for a in argvs if a[0].startswith("python")} - {None}
    assert apps == {"jobfence.worker.celery_app"}
    for module in modules:
        assert importlib.util.find_spec(str(module)) is not None, module
    # Import the app as `celery -A` does, in a clean process with no JOBFENCE_* set.
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    for app in apps:
        done = subprocess.run(
            [sys.executable, "-c", f"import {app} as m; from celery import Celery; "
             "assert isinstance(m.app, Celery)"],
            env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr


def test_the_worker_service_can_scale(services):
    worker = services["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker, "a fixed host port stops `--scale worker=N`"
    argv = words(worker["command"])
    assert argv[:4] == ["celery", "-A", "jobfence.worker.celery_app", "worker"]
    hostname = option(argv, "--hostname", "-n")
    assert hostname is not None and "%h" in hostname, "replicas need distinct node names"


def test_redis_never_evicts_and_keeps_an_append_only_file(services):
    argv = words(services["redis"]["command"])
    assert option(argv, "--maxmemory-policy") == "noeviction"
    assert option(argv, "--appendonly") == "yes"


def test_every_service_has_a_health_check(services):
    missing = [name for name, s in services.items() if not (s.get("healthcheck") or {}).get("test")]
    assert missing == []


def test_two_beats_run_the_leader_scheduler(services):
    beats = {name: s for name, s in services.items() if "beat" in words(s.get("command"))}
    assert sorted(beats) == ["beat-a", "beat-b"]
    names = {option(words(s["command"]), "--hostname", "-n") for s in beats.values()}
    assert len(names) == 2, "each beat needs its own node name for its health check"


def test_workers_and_beats_wait_for_healthy_servers(services):
    for name in ("worker", "beat-a", "beat-b"):
        depends = services[name]["depends_on"]
        assert depends["redis"]["condition"] == "service_healthy"
        assert depends["postgres"]["condition"] == "service_healthy"


def test_the_image_copies_every_folder_the_jobfence_package_maps() -> None:
    root = REPO_ROOT / "jobfence"
    needed = {"jobfence"} | {
        Path(os.readlink(p)).name for p in root.iterdir() if p.is_symlink()
    }
    assert needed >= {"jobfence", "config", "locks", "tasks", "worker"}
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (REPO_ROOT / "Dockerfile").read_text(), re.M))
    assert needed <= copied, f"Dockerfile misses {sorted(needed - copied)}"
