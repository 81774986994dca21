"""`python -m jobfence`: lock administration against a private Redis, and a real local fleet."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from devstack.procs import pid_alive, proc_state
from jobfence.config.errors import EX_CONFIG
from jobfence.locks import (
    Lease,
    NotOwner,
    OwnerMeta,
    RedisBackend,
    RedisFenceGuard,
    StaleFence,
    procinfo,
)
from jobfence.worker import admin
from jobfence.worker.cli import _load_main
from tests.servers import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
HOSTNAME = os.uname().nodename


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobfence", *args],
        env={**os.environ, **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def env(redis_url: str) -> dict[str, str]:
    return {"JOBFENCE_LOCK_URL": redis_url, "JOBFENCE_DEFAULT_TTL": "5"}


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    b = RedisBackend.from_url(redis_url)
    yield b
    b.close()


def dead_pid() -> int:
    """The pid of a process of ours that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def hold(
    backend: RedisBackend, key: str, *, pid: int, host: str = HOSTNAME, ttl: float = 60.0
) -> Lease:
    lease = backend.try_acquire(
        key, ttl, meta=OwnerMeta(host=host, pid=pid, task_id=f"id-{key}", task_name="t.job")
    )
    assert lease is not None
    return lease


def age_heartbeat(client: redis.Redis, key: str, seconds: float) -> None:
    """Make the holder of `key` look silent for `seconds` more, as a frozen holder would:
    its last heartbeat that much earlier, its TTL left that much shorter."""
    name = f"jobfence:lock:{{{key}}}"
    beat_ms = int(client.hget(name, "heartbeat_ms") or client.hget(name, "acquired_ms"))
    client.hset(name, "heartbeat_ms", beat_ms - int(seconds * 1000))
    left_ms = int(client.pttl(name)) - int(seconds * 1000)
    assert left_ms > 0, "age it by less than its TTL"
    client.pexpire(name, left_ms)


# --------------------------------------------------------------------------- locks


def test_locks_list_shows_holders_but_never_owner_tokens(env, backend):
    leases = [hold(backend, "orders:1", pid=os.getpid()), hold(backend, "stock:9", pid=1)]
    done = run_cli("locks", "list", "--json", env=env)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [item["key"] for item in listed] == ["orders:1", "stock:9"]
    assert listed[0]["pid"] == os.getpid() and listed[0]["fence"] == leases[0].fence
    assert all("owner" not in item for item in listed)
    text = run_cli("locks", "list", env=env).stdout
    for lease in leases:
        assert lease.owner not in done.stdout and lease.owner not in text
    assert "orders:1" in text and "t.job [id-orders:1]" in text


def test_locks_list_filters_with_a_glob(env, backend):
    hold(backend, "orders:1", pid=os.getpid())
    hold(backend, "stock:9", pid=os.getpid())
    done = run_cli("locks", "list", "--match", "orders:*", "--json", env=env)
    assert [item["key"] for item in json.loads(done.stdout)] == ["orders:1"]


def test_locks_inspect_shows_one_lock_or_says_it_is_free(env, backend):
    lease = hold(backend, "orders:1", pid=os.getpid())
    done = run_cli("locks", "inspect", "orders:1", env=env)
    assert done.returncode == 0
    assert f"fence:          {lease.fence}" in done.stdout
    assert f"pid {os.getpid()}" in done.stdout
    assert lease.owner not in done.stdout
    missing = run_cli("locks", "inspect", "orders:2", env=env)
    assert missing.returncode == 1 and "not held" in missing.stdout


def test_locks_release_needs_force_and_then_takes_the_lock_from_its_holder(env, backend):
    lease = hold(backend, "orders:1", pid=os.getpid())
    refused = run_cli("locks", "release", "orders:1", env=env)
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert backend.inspect("orders:1") is not None
    done = run_cli("locks", "release", "orders:1", "--force", env=env)
    assert done.returncode == 0 and "released" in done.stdout
    assert backend.inspect("orders:1") is None
    with pytest.raises(NotOwner):  # the old holder finds out at its next heartbeat
        backend.extend(lease)
    again = run_cli("locks", "release", "orders:1", "--force", env=env)
    assert again.returncode == 1 and "not held" in again.stdout


# A real holder process: takes KEY with the default owner meta, writes RESOURCE through the
# Redis guard once, then writes again under its fence each time the test asks it to.
HOLDER = """
import sys, redis
from jobfence.locks import RedisBackend, RedisFenceGuard, StaleFence
url, key, resource, ttl = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
backend = RedisBackend.from_url(url)
lease = backend.try_acquire(key, ttl)
client = redis.Redis.from_url(url, decode_responses=True)
guard = RedisFenceGuard(client)
guard.write(resource, lease.fence, [("RPUSH", "writes", "first")])
client.rpush("holder:out", f"ready {lease.fence}")
while True:
    got = client.blpop(["holder:in"], timeout=1)  # short: redis-py's socket timeout is 5 s
    if got is None:
        continue
    n = got[1]
    try:
        guard.write(resource, lease.fence, [("RPUSH", "writes", n)], write_id=n)
        client.rpush("holder:out", "written")
    except StaleFence as exc:
        client.rpush("holder:out", f"stale {exc.last}")
"""


def start_holder(process_group, redis_url: str, key: str, *, ttl: float = 600.0):
    proc = process_group.spawn(
        [sys.executable, "-c", HOLDER, redis_url, key, "account:1", str(ttl)], name="holder"
    )
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    got = holder_says(client, timeout=90, what="the holder did not start")
    return proc, int(got.split()[1]), client


def holder_says(client: redis.Redis, *, timeout: float, what: str) -> str:
    # Short blocking pops: redis-py's socket timeout (5 s by default) would cut a long one.
    got = wait_for(lambda: client.blpop(["holder:out"], timeout=1), timeout=timeout, message=what)
    return str(got[1])


def ask_holder_to_write(client: redis.Redis, n: int) -> str:
    client.rpush("holder:in", str(n))
    return holder_says(client, timeout=60, what="the holder did not answer")


def orphans(env: dict[str, str], *args: str) -> dict[str, dict[str, object]]:
    done = run_cli("locks", "orphans", "--json", *args, env=env)
    assert done.returncode == 0, done.stderr
    return {item["key"]: item for item in json.loads(done.stdout)}


def test_orphans_never_releases_a_live_holder_with_a_long_ttl_and_an_old_heartbeat(
    env, backend, redis_client
):
    """Its keeper beats every TTL/3: 200 s apart with a 600 s TTL, far beyond 2 x the default."""
    lease = backend.try_acquire("long", 600.0)  # this very process, as a task would
    assert lease is not None
    age_heartbeat(redis_client, "long", 60.0)  # > 2 x JOBFENCE_DEFAULT_TTL (5 s)
    assert "long" not in orphans(env, "--release")  # nothing wrong: not even reported
    age_heartbeat(redis_client, "long", 340.0)  # 400 s: late for its own TTL: reported, kept
    found = orphans(env, "--release")["long"]
    assert found["dead"] is False and found["released"] is False
    assert "heartbeat is late" in str(found["reason"]) and "TTL" in str(found["reason"])
    assert backend.inspect("long") is not None


def test_orphans_never_releases_a_stopped_holder(env, redis_url, redis_client, process_group):
    proc, fence, client = start_holder(process_group, redis_url, "frozen")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: proc_state(proc.pid) == "T", timeout=10, message="not stopped")
        age_heartbeat(redis_client, "frozen", 400.0)  # silent for most of its TTL
        found = orphans(env, "--release")["frozen"]
        assert found["dead"] is False and found["released"] is False
        assert f"pid {proc.pid} is stopped" in str(found["reason"])
        assert client.hget("jobfence:lock:{frozen}", "fence") == str(fence)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    client.close()


def test_orphans_releases_a_holder_killed_outright(env, redis_url, backend, process_group):
    proc, _, client = start_holder(process_group, redis_url, "killed")
    assert orphans(env) == {}  # alive and beating: nothing to report
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    found = orphans(env, "--release")["killed"]
    assert found["dead"] is True and found["released"] is True
    assert f"pid {proc.pid} is not running" in str(found["reason"])
    assert backend.inspect("killed") is None
    client.close()


def test_orphans_releases_a_lock_whose_pid_was_reused(env, backend):
    """Our pid is alive, but not the process that took the lock: its start time differs."""
    started_earlier = f"{procinfo.namespace()}/1"
    backend.try_acquire(
        "reused", 60, meta=OwnerMeta(host=HOSTNAME, pid=os.getpid(), process_start=started_earlier)
    )
    found = orphans(env, "--release")["reused"]
    assert found["dead"] is True and found["released"] is True
    assert "started after the grant" in str(found["reason"])
    assert backend.inspect("reused") is None


def test_orphans_reports_but_never_releases_a_lock_held_elsewhere(env, backend, redis_client):
    hold(backend, "elsewhere", pid=dead_pid(), host="another-host", ttl=600)  # pid says nothing
    hold(backend, "elsewhere-beating", pid=dead_pid(), host="another-host")
    age_heartbeat(redis_client, "elsewhere", 400.0)  # late for its 600 s TTL
    found = orphans(env, "--release")
    assert set(found) == {"elsewhere"}
    assert found["elsewhere"]["dead"] is False and found["elsewhere"]["released"] is False
    assert "held on host another-host" in str(found["elsewhere"]["reason"])
    assert backend.inspect("elsewhere") is not None
    text = run_cli("locks", "orphans", env=env).stdout
    assert "suspect: held on host another-host" in text and "no proof" in text


def test_orphans_releases_only_the_grant_it_judged(backend):
    """Owner-checked: a lock that changed hands since it was judged is left alone."""
    judged = hold(backend, "moved", pid=dead_pid())
    assert backend.force_release("moved")
    newer = hold(backend, "moved", pid=os.getpid())
    assert not admin.release_grant(backend, "moved", judged.fence)
    assert backend.inspect("moved").fence == newer.fence
    assert admin.release_grant(backend, "moved", newer.fence)


# --------------------------------------------------------------------------- force release


def test_force_release_alone_leaves_the_holders_writes_accepted(env, redis_url, process_group):
    """The control: releasing a lock does not stop its holder's fenced writes."""
    _, fence, client = start_holder(process_group, redis_url, "pay:1")
    done = run_cli("locks", "release", "pay:1", "--force", env=env)
    assert done.returncode == 0, done.stderr
    assert f"released (was fence {fence}" in done.stdout
    assert "may still write until a newer fence is accepted" in done.stdout
    assert ask_holder_to_write(client, 1) == "written"
    client.close()


def test_force_release_with_fence_resource_refuses_the_holders_writes_at_once(
    env, redis_url, backend, process_group
):
    _, fence, client = start_holder(process_group, redis_url, "pay:1")
    done = run_cli("locks", "release", "pay:1", "--force", "--fence-resource", "account:1", env=env)
    assert done.returncode == 0, done.stderr
    floor = int(re.search(r"fence advanced to (\d+)", done.stdout)[1])
    assert floor > fence
    assert f"account:1: guard floor now {floor}: writes with an earlier" in done.stdout
    assert ask_holder_to_write(client, 1) == f"stale {floor}"  # at once, no newer holder yet
    successor = backend.try_acquire("pay:1", 30)
    assert successor is not None and successor.fence > floor
    guard = RedisFenceGuard(redis.Redis.from_url(redis_url))
    guard.write("account:1", successor.fence, [("RPUSH", "writes", "successor")])
    assert client.lrange("writes", 0, -1) == ["first", "successor"]
    client.close()


def test_force_release_of_a_free_key_still_raises_the_floor(env, backend, redis_client):
    """A holder whose lease expired may still write: the floor rises though nothing is held."""
    expired = backend.try_acquire("pay:2", 30)
    assert expired is not None and backend.release(expired)
    guard = RedisFenceGuard(redis_client)
    guard.write("account:2", expired.fence, [("RPUSH", "writes", "before")])
    done = run_cli("locks", "release", "pay:2", "--force", "--fence-resource", "account:2", env=env)
    assert done.returncode == 1 and "pay:2: not held" in done.stdout
    assert "account:2: guard floor now" in done.stdout
    with pytest.raises(StaleFence):
        guard.write("account:2", expired.fence, [("RPUSH", "writes", "late")], write_id="late")
    assert redis_client.lrange("writes", 0, -1) == [b"before"]


def test_the_check_command_reports_an_evicting_lock_server(fresh_redis):
    env = {"JOBFENCE_LOCK_URL": fresh_redis.url}
    assert run_cli("check", env=env).returncode == 0
    fresh_redis.client().config_set("maxmemory-policy", "allkeys-random")
    done = run_cli("check", env=env)
    assert done.returncode == EX_CONFIG
    assert "REFUSED" in done.stdout and "allkeys-random" in done.stdout


def test_the_check_command_reports_whether_the_lock_server_answers(fresh_redis):
    done = run_cli("check", env={"JOBFENCE_LOCK_URL": fresh_redis.url})
    assert re.search(r"redis lock backend: ok in [0-9.]+ ms \(PONG\)", done.stdout), done.stdout
    fresh_redis.stop()
    done = run_cli("check", env={"JOBFENCE_LOCK_URL": fresh_redis.url})
    assert "redis lock backend: NOT ANSWERING" in done.stdout, done.stdout
    assert "ConnectionError" in done.stdout


def test_bench_without_a_name_prints_its_usage(env):
    done = run_cli("bench", env=env)
    usage = "bench {locks|celery|gate|leader|memory|keeper|server|publish}"
    assert done.returncode == 2 and usage in done.stderr


def test_a_missing_optional_command_says_so(capsys):
    assert _load_main("jobfence.worker.no_such_module", "the thing", "not written yet") is None
    assert "the thing is not available" in capsys.readouterr().err


# --------------------------------------------------------------------------- fleet


class Output:
    """Collects a process's output lines on a thread, so the test can wait for one."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.append(line.rstrip("\n"))

    def find(self, pattern: str) -> re.Match[str] | None:
        for line in list(self.lines):
            if m := re.search(pattern, line):
                return m
        return None

    def text(self, last: int = 80) -> str:
        return "\n".join(self.lines[-last:])

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


class RunningFleet:
    """`python -m jobfence fleet ...` with the embedded stack, up and ready."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBFENCE_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jobfence", "fleet", *args],
            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.out = Output(self.proc.stdout)

    def wait_ready(self) -> None:
        wait_for(lambda: self.out.find(r"^fleet: ready: "), timeout=120, message=self.out.text)
        text = "\n".join(self.out.lines)
        self.pids = {m: int(p) for m, p in re.findall(r"^fleet: (\S+) pid (\d+)$", text, re.M)}
        stack = self.out.find(r"^fleet: embedded redis-server pid (\d+) at (\S+) \(data in (\S+)\)")
        assert stack is not None
        self.redis_pid, self.redis_url, self.data_dir = int(stack[1]), stack[2], Path(stack[3])
        self.pool = [c for pid in self.pids.values() for c in _children(pid)]
        self.everything = [*self.pids.values(), *self.pool, self.redis_pid]

    def close(self) -> None:
        """Stop it if a test left it running: Ctrl-C first, SIGKILL as a last resort."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its children get SIGTERM from
                self.proc.wait()  # the kernel (parent-death signal)
        self.out.join(timeout=10)


def test_fleet_starts_real_workers_and_stops_everything_on_ctrl_c():
    fleet = RunningFleet("--workers", "2", "--concurrency", "1")
    try:
        fleet.wait_ready()
        assert fleet.out.find(r"^fleet: ready: 2 workers, 1 beats")
        assert sorted(fleet.pids) == ["beat-1", "worker-1", "worker-2"]
        client = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
        assert client.ping()
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        client.close()
        assert len(fleet.pool) >= 2  # one prefork child per worker

        fleet.proc.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends
        assert fleet.proc.wait(timeout=90) == 0, fleet.out.text()
    finally:
        fleet.close()
    out = fleet.out
    assert out.find(r"^fleet: stopped$"), out.text()
    for name in ("worker-1", "worker-2", "beat-1"):
        assert out.find(rf"^fleet: {name} \(pid \d+\) exited with 0$"), out.text()
    assert [pid for pid in fleet.everything if pid_alive(pid)] == []
    assert not fleet.data_dir.exists()


def test_a_fleet_killed_outright_leaves_no_process_behind():
    fleet = RunningFleet("--workers", "1", "--concurrency", "1", "--no-beat")
    try:
        fleet.wait_ready()
        os.killpg(fleet.proc.pid, signal.SIGKILL)  # no chance to clean up
        fleet.proc.wait()
        wait_for(
            lambda: not [pid for pid in fleet.everything if pid_alive(pid)],
            timeout=60,
            message=lambda: f"still alive: {[p for p in fleet.everything if pid_alive(p)]}",
        )
    finally:
        fleet.close()
        if hasattr(fleet, "data_dir"):
            shutil.rmtree(fleet.data_dir, ignore_errors=True)


def test_fleet_stops_when_a_worker_cannot_start(fresh_redis):
    fresh_redis.client().config_set("maxmemory-policy", "allkeys-lru")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "jobfence", "fleet", "--workers", "1", "--no-beat"],
        env={**os.environ, "JOBFENCE_LOCK_URL": fresh_redis.url}, cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout
    assert "refusing to start the worker" in done.stdout
    assert "exited on its own; stopping" in done.stdout
    assert time.monotonic() - started < 60
