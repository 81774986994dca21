"""docker-compose.yml: configured through real JOBFENCE_* settings, scalable, health-checked."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
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
        env = dict(services[name].get("environment") or {})
        assert env, f"{name} has no environment"
        if name == "flower":  # Flower's own login, the one variable that is not ours
            env.pop("FLOWER_BASIC_AUTH")
        assert all(key.startswith(ENV_PREFIX) for key in env), (name, sorted(env))


def test_flower_asks_for_a_password_kept_off_its_command_line(services):
    """Flower shows task arguments and revokes tasks: basic auth with the password from .env,
    in the environment (a command line is readable by every user of the host); the health
    check uses /healthcheck, which Flower answers without a login."""
    flower = services["flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"] == (
        "admin:${FLOWER_PASSWORD:?set FLOWER_PASSWORD in .env (see .env.example)}"
    )
    assert "FLOWER_PASSWORD" not in str(flower["command"]) and "basic_auth" not in str(
        flower["command"]
    )
    assert flower["ports"] == ["127.0.0.1:5555:5555"]
    assert any("/healthcheck" in part for part in flower["healthcheck"]["test"])
    # The rest of its environment is the fleet's, so it reads the same broker and settings.
    worker_env = services["worker"]["environment"]
    rest = {k: v for k, v in flower["environment"].items() if k != "FLOWER_BASIC_AUTH"}
    assert rest and all(worker_env[k] == v for k, v in rest.items())
    assert "JOBFENCE_BROKER_URL" in rest and "JOBFENCE_KEY_SECRET" in rest


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
    assert apps == {"demo.app"}
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
    assert argv[:4] == ["celery", "-A", "demo.app", "worker"]
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


EXAMPLE_SECRETS = {
    "JOBFENCE_KEY_SECRET": "compose-check-only-0123456789abcdef0123",
    "REDIS_PASSWORD": "ComposeRedisPW0123",
    "POSTGRES_PASSWORD": "ComposePgPW0123",
    "GRAFANA_ADMIN_PASSWORD": "ComposeGrafanaPW0123",
    "FLOWER_PASSWORD": "ComposeFlowerPW0123",
}
DEFAULT_SERVICES = (
    "redis", "postgres", "worker", "beat-a", "beat-b", "flower", "prometheus", "grafana",
)  # fmt: skip


def test_no_password_is_committed_and_the_env_file_is_not(services) -> None:
    text = COMPOSE.read_text()
    assert "POSTGRES_PASSWORD: jobfence" not in text
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith(
        "${POSTGRES_PASSWORD:?"
    )
    argv = words(services["redis"]["command"])
    required = "${REDIS_PASSWORD:?set REDIS_PASSWORD in .env (see .env.example)}"
    assert option(argv, "--requirepass") == required
    assert services["redis"]["environment"]["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD")
    example = (REPO_ROOT / ".env.example").read_text()
    for name in EXAMPLE_SECRETS:
        assert re.search(rf"(?m)^{name}=$", example), f".env.example does not list {name}"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=REPO_ROOT)
    assert ignored.returncode == 0, ".env must be ignored by git"
    assert ".env" in (REPO_ROOT / ".dockerignore").read_text().split()


def test_containers_run_without_root_on_a_read_only_file_system(services) -> None:
    assert set(DEFAULT_SERVICES) | SENTINEL_PROFILE <= set(services)
    for name, service in services.items():  # every service of every profile
        user = str(service.get("user", ""))
        assert user and not user.startswith(("0", "root")), f"{name} runs as root"
        assert service.get("read_only") is True, f"{name} has a writable root file system"
        assert "/tmp" in (service.get("tmpfs") or []), name
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in (service.get("security_opt") or []), name


def test_the_sentinel_profile_asks_for_the_password_from_the_env_file(
    services: dict[str, dict[str, Any]],
) -> None:
    required = "${REDIS_PASSWORD:?set REDIS_PASSWORD in .env (see .env.example)}"
    for name in SENTINEL_PROFILE:
        assert services[name]["environment"]["REDISCLI_AUTH"] == required, name
        if name.startswith("lock-"):
            argv = words(services[name]["command"])
            assert option(argv, "--requirepass") == option(argv, "--masterauth") == required
        else:  # the sentinel's own login and its login to the master, from the environment
            script = words(services[name]["command"])[2]
            assert "requirepass $$REDISCLI_AUTH" in script
            assert "sentinel auth-pass locks $$REDISCLI_AUTH" in script
    assert "no-auth" not in COMPOSE.read_text()
    assert re.search(r"(?m)^USER jobfence$", (REPO_ROOT / "Dockerfile").read_text())


def test_the_stacks_settings_pass_the_security_start_up_check(services) -> None:
    """The worker's environment, as compose fills it in from .env.example's names, loads
    and passes check_security: its one downgrade (clear text on the private network) is
    allowed by name, so it is a warning, not a refusal."""
    from types import SimpleNamespace

    from jobfence.worker.checks import check_security

    values = {**EXAMPLE_SECRETS, "JOBFENCE_ALLOW_INSECURE": "cleartext"}

    def filled(text: str) -> str:
        def one(match: re.Match[str]) -> str:
            name, default = match[1], match[3] or ""
            return values.get(name, default if match[2] == ":-" else "")

        for _ in range(2):  # one default holds another variable
            text = re.sub(r"\$\{(\w+)(?:(:-|:\?)((?:[^{}]|\$\{\w+\})*))?\}", one, text)
        return text

    env = {k: filled(str(v)) for k, v in services["worker"]["environment"].items()}
    assert "ComposeRedisPW0123" in env["JOBFENCE_LOCK_URL"]
    settings = Settings(**{k[len(ENV_PREFIX):].lower(): v for k, v in env.items()})
    conf = SimpleNamespace(broker_url=settings.broker_url, result_backend=settings.result_backend)
    found = list(check_security(conf, SimpleNamespace(settings=settings)))
    assert found and not [f for f in found if f.refuse], found
    assert all("JOBFENCE_ALLOW_INSECURE=cleartext" in f.problem for f in found)
    assert not any(p in str(f) for f in found for p in EXAMPLE_SECRETS.values())


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (.ci/setup installs Debian's)")
    env = {**os.environ, **EXAMPLE_SECRETS}
    return subprocess.run(
        [exe, "-f", str(COMPOSE), *args], env=env, cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("profile", [[], ["--profile", "sentinel"]], ids=["default", "sentinel"])
def test_docker_compose_accepts_the_file(profile: list[str]) -> None:
    done = _compose(*profile, "config", "-q")
    assert done.returncode == 0, done.stderr


SENTINEL_PROFILE = {
    "lock-master", "lock-replica-1", "lock-replica-2", "sentinel-1", "sentinel-2", "sentinel-3",
}


def test_the_sentinel_profile_is_optional(services):
    profiled = {name for name, s in services.items() if "sentinel" in (s.get("profiles") or [])}
    assert profiled == SENTINEL_PROFILE  # `docker compose up` without --profile skips them
    for name in ("worker", "beat-a", "beat-b", "flower"):
        assert not SENTINEL_PROFILE & set(services[name].get("depends_on") or {}), name


def _sentinel_url_in_comment() -> str:
    """The comment's URL, with the shell's $REDIS_PASSWORD filled in."""
    found = re.search(r'JOBFENCE_LOCK_URL="?(redis\+sentinel://[^"\s]+)', COMPOSE.read_text())
    assert found is not None, "the compose file's comment shows no redis+sentinel:// URL"
    return found[1].replace("$REDIS_PASSWORD", EXAMPLE_SECRETS["REDIS_PASSWORD"])


def _filled(word: str) -> str:
    """A compose value with ${REDIS_PASSWORD...} filled in as compose would from .env."""
    return re.sub(r"\$\{REDIS_PASSWORD[^}]*\}", EXAMPLE_SECRETS["REDIS_PASSWORD"], word)


def test_the_sentinel_profile_replayed_on_this_host_grants_locks_through_its_url(
    services, tmp_path: Path
) -> None:
    """Run the profile's own commands (hosts and ports mapped to free local ones) and take a
    lock through the URL its comment gives, with the start-up checks passing."""
    from devstack.redis_server import HOST, free_port
    from jobfence.config.urls import sentinel_target
    from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend
    from tests.servers import stop_process, wait_for

    target = sentinel_target(_sentinel_url_in_comment())
    hosts = [h for h, _ in target.sentinels]
    assert sorted(hosts) == ["sentinel-1", "sentinel-2", "sentinel-3"]
    master_port = free_port()

    def redis_argv(name: str) -> list[str]:
        argv = [_filled(w) for w in words(services[name]["command"])]
        assert option(argv, "--maxmemory-policy") == "noeviction"
        assert option(argv, "--appendonly") == "yes"
        if "--replicaof" in argv:
            i = argv.index("--replicaof")
            assert argv[i + 1 : i + 3] == ["lock-master", "6379"]
            argv[i + 1 : i + 3] = [HOST, str(master_port)]
        port = master_port if name == "lock-master" else free_port()
        (tmp_path / name).mkdir()
        return [*argv, "--port", str(port), "--bind", HOST, "--dir", str(tmp_path / name)]

    script = words(services["sentinel-1"]["command"])[2]
    conf = re.search(r"<<'?CONF'?\n(.*?)\n\s*CONF\n", script, re.S)
    assert conf is not None and "exec redis-server /tmp/sentinel.conf --sentinel" in script
    password = EXAMPLE_SECRETS["REDIS_PASSWORD"]  # REDISCLI_AUTH, as the shell expands it
    lines = [line.strip().replace("$$REDISCLI_AUTH", password) for line in conf[1].splitlines()]
    assert f"sentinel monitor {target.service} lock-master 6379 2" in lines
    procs: list[subprocess.Popen[bytes]] = []
    sentinels: list[tuple[str, int]] = []
    try:
        for name in ("lock-master", "lock-replica-1", "lock-replica-2"):
            argv = redis_argv(name)
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
        for name in sorted(hosts):
            port = free_port()
            local = [
                line.replace("port 26379", f"port {port}")
                .replace("lock-master 6379", f"{HOST} {master_port}")
                for line in lines
            ]
            path = tmp_path / f"{name}.conf"
            path.write_text("\n".join([*local, f"bind {HOST}", f"dir {tmp_path}", ""]))
            procs.append(subprocess.Popen(["redis-server", str(path), "--sentinel"],
                                          stdout=subprocess.DEVNULL))  # fmt: skip
            sentinels.append((HOST, port))
        assert target.password == target.sentinel_password == password
        url = f"redis+sentinel://:{password}@" + ",".join(f"{h}:{p}" for h, p in sentinels)
        url += f"/{target.service}/{target.db}?sentinel_password={password}"

        def ready() -> bool:
            try:
                backend = RedisSentinelBackend.from_url(url, prefix="compose")
            except Exception:
                return False
            try:
                topo = backend.topology()
                return topo.master is not None and len(topo.replicas) == 2
            finally:
                backend.close()

        wait_for(ready, timeout=30, interval=0.1, message="the replayed Sentinel profile is not up")
        backend = RedisSentinelBackend.from_url(url, prefix="compose")
        try:
            lease = backend.try_acquire("compose:probe", ttl=5)
            assert lease is not None and lease.fence > 0
            assert backend.release(lease)
        finally:
            backend.close()
        for host, port in [(HOST, master_port), *sentinels]:  # none answers without it
            anonymous = redis.Redis(host, port, socket_timeout=5)
            with anonymous, pytest.raises(redis.AuthenticationError):
                anonymous.ping()
    finally:
        for proc in reversed(procs):
            stop_process(proc)


PROMETHEUS_CONFIG = REPO_ROOT / "deploy" / "prometheus.yml"


def test_prometheus_scrapes_every_worker_on_its_metrics_port(services):
    worker = services["worker"]
    port = int(worker["environment"]["JOBFENCE_METRICS_PORT"])
    assert Settings(lock_url="memory://", metrics_port=port).metrics_port == port  # valid
    assert str(port) in [str(p) for p in worker.get("expose") or []]
    assert "ports" not in worker  # reachable on the compose network only, any replica count
    for name in ("beat-a", "beat-b", "flower"):  # one endpoint per worker, nothing else
        assert "JOBFENCE_METRICS_PORT" not in (services[name].get("environment") or {}), name

    prometheus = services["prometheus"]
    assert str(prometheus["image"]).startswith("prom/prometheus")
    config_file = option(words(prometheus["command"]), "--config.file")
    assert config_file is not None
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"] if ":" in v}
    assert config_file in mounts, "the config Prometheus reads is not mounted"
    assert (REPO_ROOT / mounts[config_file]).resolve() == PROMETHEUS_CONFIG.resolve()

    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = [
        (sd["names"], sd.get("type", "SRV"), sd.get("port"))
        for job in config["scrape_configs"]
        if job.get("metrics_path", "/metrics") == "/metrics"
        for sd in job.get("dns_sd_configs") or []
    ]
    # An A lookup of the service name lists every replica: --scale needs no change.
    assert (["worker"], "A", port) in targets, targets


GRAFANA = REPO_ROOT / "deploy" / "grafana"


def exported_metrics() -> set[str]:
    """Every series name jobfence exports, read from tasks/metrics.py's registry itself."""
    from jobfence.tasks.metrics import Metrics

    names: set[str] = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        suffixes = {
            "histogram": ("_bucket", "_count", "_sum"),
            "counter": ("_total",),
        }.get(family.type, ())
        names |= {family.name + s for s in suffixes}
    return names


def test_grafana_is_provisioned_with_prometheus_and_the_jobfence_dashboard(services):
    grafana = services["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")}
    provisioning = REPO_ROOT / mounts["/etc/grafana/provisioning"]
    dashboards = REPO_ROOT / mounts["/var/lib/grafana/dashboards"]
    assert provisioning.resolve() == (GRAFANA / "provisioning").resolve()
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith(
        "${GRAFANA_ADMIN_PASSWORD:?"
    )
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]

    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "prometheus" in services

    providers = yaml.safe_load((provisioning / "dashboards" / "jobfence.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    files = sorted(dashboards.glob("*.json"))
    assert [f.name for f in files] == ["jobfence.json"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/var/lib/grafana/dashboards/jobfence.json"


def test_every_grafana_panel_queries_metrics_jobfence_exports() -> None:
    dashboard = json.loads((GRAFANA / "dashboards" / "jobfence.json").read_text())
    source_uid = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]["uid"]
    exported = exported_metrics()
    used: set[str] = set()
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source_uid, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bjobfence_[a-z_]+", target["expr"]))
            assert names, f"{panel['title']}: no jobfence metric in {target['expr']!r}"
            assert names <= exported, f"{panel['title']}: not exported: {names - exported}"
            used |= names
    # What the issue asks the dashboard to show, each by the metric that counts it.
    for wanted in [
        "jobfence_acquire_wait_seconds_count", "jobfence_conflicts_total",
        "jobfence_lost_leases_total", "jobfence_stale_fence_total",
        "jobfence_idempotent_replays_total", "jobfence_heartbeat_seconds_bucket",
        "jobfence_semaphore_slots_held", "jobfence_rate_limit_wait_seconds_bucket",
    ]:  # fmt: skip
        assert wanted in used, wanted
    titles = [p["title"] for p in dashboard["panels"]]
    assert len(titles) == len(set(titles))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
