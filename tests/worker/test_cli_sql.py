"""`jobfence locks ...` on PostgreSQL and MariaDB locks, set by JOBFENCE_LOCK_URL alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pymysql  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa

from devstack.procs import proc_state
from jobfence.locks import Lease, LockBackend, NotOwner, OwnerMeta, open_backend, procinfo
from jobfence.locks.backends.mysql import MySQLBackend, key_hash
from jobfence.locks.backends.postgres import TABLE as PG_TABLE
from tests.servers import ProcessGroup, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
HOSTNAME = os.uname().nodename


@pytest.fixture(params=["postgres", "mariadb"])
def lock_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue("pg_url" if request.param == "postgres" else "mariadb_url")
    return url


@pytest.fixture
def prefix() -> str:
    """A key prefix per test: the scratch databases live for the whole session."""
    return f"cli{uuid.uuid4().hex[:8]}"


@pytest.fixture
def env(lock_url: str, prefix: str) -> dict[str, str]:
    return {
        "JOBFENCE_LOCK_URL": lock_url,
        "JOBFENCE_KEY_PREFIX": prefix,
        "JOBFENCE_DEFAULT_TTL": "5",
    }


@pytest.fixture
def backend(lock_url: str, prefix: str) -> Iterator[LockBackend]:
    b = open_backend(lock_url, prefix=prefix)
    yield b
    b.close()


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobfence", *args],
        env={**os.environ, **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def dead_pid() -> int:
    """The pid of a process of ours that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def hold(
    backend: LockBackend, key: str, *, pid: int, host: str = HOSTNAME, ttl: float = 60.0
) -> Lease:
    lease = backend.try_acquire(
        key, ttl, meta=OwnerMeta(host=host, pid=pid, task_id=f"id-{key}", task_name="t.job")
    )
    assert lease is not None
    return lease


def age_heartbeat(backend: LockBackend, lock_url: str, key: str, seconds: float) -> None:
    """Make the holder of `key` look silent for `seconds` more, as a frozen holder would:
    its last heartbeat that much earlier, its TTL left that much shorter (server clock)."""
    if isinstance(backend, MySQLBackend):
        args = sa.make_url(lock_url)
        conn = pymysql.connect(
            host=args.host, port=args.port, user=args.username, database=args.database
        )
        try:
            with conn.cursor() as cur:
                cur.execute(
                    f"UPDATE {backend.tables['locks']} SET heartbeat_at = heartbeat_at"
                    " - INTERVAL %(us)s MICROSECOND, expires_at = expires_at - INTERVAL %(us)s"
                    " MICROSECOND WHERE key_hash = %(h)s AND expires_at > NOW(6)"
                    " + INTERVAL %(us)s MICROSECOND",
                    {"us": int(seconds * 1e6), "h": key_hash(key)},
                )
                assert cur.rowcount == 1, "age it by less than its TTL left"
            conn.commit()
        finally:
            conn.close()
        return
    plain = lock_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        done = conn.execute(
            f"UPDATE {PG_TABLE} SET heartbeat_at = coalesce(heartbeat_at, acquired_at) - %(s)s"
            " * interval '1 second', expires_at = expires_at - %(s)s * interval '1 second'"
            " WHERE prefix = %(p)s AND key = %(k)s"
            " AND expires_at > clock_timestamp() + %(s)s * interval '1 second'",
            {"s": seconds, "p": backend.prefix, "k": key},  # type: ignore[attr-defined]
        )
        assert done.rowcount == 1, "age it by less than its TTL left"


def orphans(env: dict[str, str], *args: str) -> dict[str, dict[str, Any]]:
    done = run_cli("locks", "orphans", "--json", *args, env=env)
    assert done.returncode == 0, done.stderr
    return {item["key"]: item for item in json.loads(done.stdout)}


# --------------------------------------------------------------------------- list, inspect


def test_locks_list_shows_holders_but_never_owner_tokens_and_filters_with_a_glob(env, backend):
    leases = [hold(backend, "orders:1", pid=os.getpid()), hold(backend, "stock:9", pid=1)]
    done = run_cli("locks", "list", "--json", env=env)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [item["key"] for item in listed] == ["orders:1", "stock:9"]
    assert [item["fence"] for item in listed] == [lease.fence for lease in leases]
    assert listed[0]["pid"] == os.getpid() and listed[0]["host"] == HOSTNAME
    assert all("owner" not in item for item in listed)
    assert 0 <= listed[0]["heartbeat_age"] < 30  # on the database's clock
    text = run_cli("locks", "list", env=env).stdout
    for lease in leases:
        assert lease.owner not in done.stdout and lease.owner not in text
    assert "orders:1" in text and "t.job [id-orders:1]" in text
    hold(backend, "orders_2", pid=os.getpid())  # '_' is a LIKE wildcard: must not match
    done = run_cli("locks", "list", "--match", "orders:*", "--json", env=env)
    assert [item["key"] for item in json.loads(done.stdout)] == ["orders:1"]


def test_locks_inspect_shows_one_lock_and_its_job_record(env, backend):
    lease = hold(backend, "orders:1", pid=os.getpid())
    done = run_cli("locks", "inspect", "orders:1", env=env)
    assert done.returncode == 0, done.stderr
    assert f"fence:          {lease.fence}" in done.stdout
    assert f"pid {os.getpid()}" in done.stdout
    assert lease.owner not in done.stdout
    job = backend.begin("orders:2", 30.0, record=True, fingerprint="fp")
    assert isinstance(job, Lease)
    assert backend.commit(job, state="DONE", result='{"ok":1}', fingerprint="fp", result_ttl=60)
    finished = run_cli("locks", "inspect", "orders:2", "--json", env=env)
    assert finished.returncode == 1  # not held ...
    shown = json.loads(finished.stdout)
    assert shown["lock"] is None  # ... but its record answers
    assert shown["record"]["state"] == "DONE" and shown["record"]["fence"] == job.fence
    missing = run_cli("locks", "inspect", "orders:3", env=env)
    assert missing.returncode == 1 and "not held" in missing.stdout


# --------------------------------------------------------------------------- release


def test_locks_release_needs_force_and_then_takes_the_lock_from_its_holder(env, backend):
    lease = hold(backend, "orders:1", pid=os.getpid())
    refused = run_cli("locks", "release", "orders:1", env=env)
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert backend.inspect("orders:1") is not None
    done = run_cli("locks", "release", "orders:1", "--force", env=env)
    assert done.returncode == 0, done.stderr
    assert f"released (was fence {lease.fence}" in done.stdout
    floor = int(done.stdout.split("fence advanced to ")[1].split(";")[0])
    assert floor > lease.fence
    assert backend.inspect("orders:1") is None
    with pytest.raises(NotOwner):  # the old holder finds out at its next heartbeat
        backend.extend(lease)
    successor = backend.try_acquire("orders:1", 5.0)
    assert successor is not None and successor.fence > floor
    assert backend.release(successor)
    again = run_cli("locks", "release", "orders:1", "--force", env=env)
    assert again.returncode == 1 and "not held" in again.stdout


def test_fence_resource_is_refused_off_redis_naming_the_sql_alternative(env, backend):
    hold(backend, "pay:1", pid=os.getpid())
    done = run_cli("locks", "release", "pay:1", "--force", "--fence-resource", "acct:1", env=env)
    assert done.returncode != 0
    assert "--fence-resource needs the Redis lock backend" in done.stdout + done.stderr
    assert backend.inspect("pay:1") is not None  # refused before anything changed


# --------------------------------------------------------------------------- orphans

# A real holder process: takes KEY on the SQL backend with the default owner meta, says so,
# then waits (no keeper: the TTL is long).
HOLDER = """
import sys, time
from jobfence.locks import open_backend
url, prefix, key = sys.argv[1:4]
backend = open_backend(url, prefix=prefix)
lease = backend.try_acquire(key, 600.0)
print("ready", lease.fence, flush=True)
while True:
    time.sleep(1)
"""


def start_holder(group: ProcessGroup, lock_url: str, prefix: str, key: str) -> Any:
    proc = group.spawn([sys.executable, "-c", HOLDER, lock_url, prefix, key], name="holder")
    wait_for(lambda: "ready" in group.log_of(proc), timeout=60, message=lambda: group.log_of(proc))
    return proc


def test_orphans_releases_a_holder_killed_outright(env, lock_url, prefix, backend, process_group):
    proc = start_holder(process_group, lock_url, prefix, "killed")
    assert orphans(env) == {}  # alive: nothing to report
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    found = orphans(env, "--release")["killed"]
    assert found["dead"] is True and found["released"] is True
    assert f"pid {proc.pid} is not running" in found["reason"]
    assert backend.inspect("killed") is None


def test_orphans_never_releases_a_stopped_holder(env, lock_url, prefix, backend, process_group):
    proc = start_holder(process_group, lock_url, prefix, "frozen")
    fence = backend.inspect("frozen").fence
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: proc_state(proc.pid) == "T", timeout=10, message="not stopped")
        age_heartbeat(backend, lock_url, "frozen", 400.0)  # silent for most of its TTL
        found = orphans(env, "--release")["frozen"]
        assert found["dead"] is False and found["released"] is False
        assert f"pid {proc.pid} is stopped" in found["reason"]
        assert backend.inspect("frozen").fence == fence
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_orphans_releases_a_lock_whose_pid_was_reused(env, backend):
    """Our pid is alive, but not the process that took the lock: its start time differs."""
    started_earlier = f"{procinfo.namespace()}/1"
    backend.try_acquire(
        "reused", 60, meta=OwnerMeta(host=HOSTNAME, pid=os.getpid(), process_start=started_earlier)
    )
    found = orphans(env, "--release")["reused"]
    assert found["dead"] is True and found["released"] is True
    assert "started after the grant" in found["reason"]
    assert backend.inspect("reused") is None


def test_orphans_reports_but_never_releases_a_lock_held_elsewhere(env, lock_url, backend):
    hold(backend, "elsewhere", pid=dead_pid(), host="another-host", ttl=600)
    hold(backend, "elsewhere-beating", pid=dead_pid(), host="another-host")
    age_heartbeat(backend, lock_url, "elsewhere", 400.0)  # late for its 600 s TTL
    found = orphans(env, "--release")
    assert set(found) == {"elsewhere"}
    assert found["elsewhere"]["dead"] is False and found["elsewhere"]["released"] is False
    assert "held on host another-host" in found["elsewhere"]["reason"]
    assert backend.inspect("elsewhere") is not None
    text = run_cli("locks", "orphans", env=env).stdout
    assert "suspect: held on host another-host" in text and "no proof" in text
