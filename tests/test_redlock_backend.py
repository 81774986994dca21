"""Redlock beyond the contract: its URL, start-up checks, orphans, and use through the URL alone."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.redis_masters import RedisMasters
from devstack.servers import wait_for
from jobfence.config import Settings, UnsafeSettings
from jobfence.config.errors import EX_CONFIG
from jobfence.config.urls import redlock_masters
from jobfence.locks import Busy, JobRecord, Lease, open_backend
from jobfence.locks.backends.redlock import RedlockBackend
from jobfence.tasks import Runtime
from jobfence.tasks.executor import JobSpec

REPO_ROOT = Path(__file__).resolve().parents[1]
SECRET = "a-real-random-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def masters() -> Iterator[RedisMasters]:
    """Three plain masters (no AOF) for the module; tests use keys of their own."""
    with RedisMasters(3) as m:
        yield m


@pytest.fixture
def backend(masters: RedisMasters) -> Iterator[RedlockBackend]:
    b = RedlockBackend.from_url(masters.url, prefix="rl")
    yield b
    b.close()


def cli_env(masters: RedisMasters) -> dict[str, str]:
    """JOBFENCE_LOCK_URL on the masters; broker and results on the first one's other dbs."""
    first = masters.servers[0]
    return {
        "JOBFENCE_LOCK_URL": masters.url,
        "JOBFENCE_KEY_SECRET": SECRET,
        "JOBFENCE_BROKER_URL": first.db_url(1),
        "JOBFENCE_RESULT_BACKEND": first.db_url(2),
    }


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobfence", *args],
        env={**os.environ, **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------------------------- the URL


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redlock://a:1,b:2", "names 2 master(s)"),
        ("redlock://a:1,b:2,c:3,d:4", "names 4 master(s)"),
        ("redlock://a:1", "names 1 master(s)"),
        ("redlock://a:1,a:1,b:2", "names master a:1 more than once"),
        ("redlock://a:1,,b:2", "empty master"),
        ("redlock://a:1,b:x,c:3", "port 'x'"),
        ("redlock://a:1,b:2,c:3/zero", "database 'zero'"),
        ("redlock://a:1,b:2,c:3?socket_timeout=1", "does not take"),
    ],
)
def test_an_unusable_redlock_url_is_refused_naming_the_variable(url: str, problem: str) -> None:
    with pytest.raises(UnsafeSettings) as refused:
        Settings(lock_url=url, key_secret=SECRET)
    text = str(refused.value)
    assert "JOBFENCE_LOCK_URL" in text and problem in text
    assert "redlock://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379" in text or "once" in text


def test_the_redlock_url_gives_every_master_its_credentials_and_db() -> None:
    assert redlock_masters("redlock://u:s3cret@h1:7001,h2,[::1]:7003/2") == [
        "redis://u:s3cret@h1:7001/2",
        "redis://u:s3cret@h2:6379/2",
        "redis://u:s3cret@[::1]:7003/2",
    ]
    with pytest.raises(UnsafeSettings) as refused:
        redlock_masters("redlock://u:s3cret@h1:1,h2:2")
    assert "s3cret" not in str(refused.value)


def test_open_backend_builds_redlock_from_the_url(masters: RedisMasters) -> None:
    backend = open_backend(masters.url, prefix="rl", socket_timeout=0.5)
    try:
        assert isinstance(backend, RedlockBackend)
        assert (len(backend.masters), backend.quorum, backend.socket_timeout) == (3, 2, 0.5)
        assert backend.capabilities.ha and backend.capabilities.native_fencing
    finally:
        backend.close()


# --------------------------------------------------------------------------- start-up checks


def test_masters_without_a_crash_proof_aof_are_warned_about_and_the_fence_not_durable(
    backend: RedlockBackend,
) -> None:
    findings = backend.check_servers()
    assert len(findings) == 3 and not any(refuse for refuse, _, _ in findings)
    assert all("appendfsync" in problem for _, problem, _ in findings)
    assert backend.capabilities.durable_fence is False


def test_masters_with_aof_fsync_always_make_the_fence_durable() -> None:
    with RedisMasters(3, durable=True) as m:
        b = RedlockBackend.from_url(m.url)
        try:
            assert not type(b).capabilities.durable_fence  # unknown until checked
            assert b.check_servers() == []
            assert b.capabilities.durable_fence
            m.client(1).config_set("appendfsync", "everysec")
            assert len(b.check_servers()) == 1
            assert not b.capabilities.durable_fence
        finally:
            b.close()


def test_the_check_command_refuses_an_evicting_master(masters: RedisMasters) -> None:
    admin = masters.client(2)
    admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        done = run_cli("check", env=cli_env(masters))
        assert done.returncode == EX_CONFIG
        assert "REFUSED" in done.stdout and "allkeys-lru" in done.stdout
        assert "appendfsync" in done.stdout  # and the warnings
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()


def test_a_dead_master_is_warned_about_and_grants_go_on(masters: RedisMasters) -> None:
    five = RedlockBackend.from_url(masters.url + ",127.0.0.1:1,127.0.0.1:2", prefix="rl")
    try:
        findings = five.check_servers()
        dead = [p for refuse, p, _ in findings if "does not answer" in p]
        assert len(dead) == 2 and "127.0.0.1:1" in dead[0] and not any(r for r, _, _ in findings)
        lease = five.try_acquire("dead", 5.0)  # three of five answer: a majority
        assert lease is not None and lease.release()
    finally:
        five.close()


# --------------------------------------------------------------------------- no orphans


def lock_keys(masters: RedisMasters, prefix: str) -> list[list[str]]:
    return masters.keys(f"{prefix}:lock:*")


def test_no_lock_key_is_left_on_any_master_after_many_pairs_and_jobs(
    masters: RedisMasters,
) -> None:
    backend = RedlockBackend.from_url(masters.url, prefix="orph")
    for i in range(300):
        lease = backend.try_acquire("pair", 10.0)
        assert lease is not None and lease.release()
        job = backend.begin(f"job-{i}", 10.0, record=True, fingerprint="fp")
        assert isinstance(job, Lease)
        assert backend.commit(job, state="DONE", result="1", fingerprint="fp", result_ttl=60)
    backend.close()  # waits for the replies still owed, so everything sent has run
    assert lock_keys(masters, "orph") == [[], [], []]
    # Each record on a majority at least (a master too slow on a loaded CI is dropped from
    # the round and misses what was not sent to it; the majority decides).
    per_record = Counter(name for names in masters.keys("orph:job:*") for name in set(names))
    assert len(per_record) == 300 and min(per_record.values()) >= 2, per_record.most_common(3)


def test_contenders_that_lose_leave_no_lock_key_behind(masters: RedisMasters) -> None:
    """Threads race for one key: split votes and refusals release what they took."""
    clients = [RedlockBackend.from_url(masters.url, prefix="race") for _ in range(6)]
    grants: list[int] = []
    busy = [0]

    def run(b: RedlockBackend) -> None:
        for _ in range(100):
            got = b.attempt("hot", 5.0)
            if isinstance(got, Lease):
                grants.append(got.fence)
                assert got.release()
            else:
                busy[0] += 1

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    assert grants and busy[0], "no contention happened: the test proves nothing"
    assert len(set(grants)) == len(grants)
    assert lock_keys(masters, "race") == [[], [], []]


# --------------------------------------------------------------------------- above the backend


def test_the_executor_runs_a_job_once_through_the_url_alone(masters: RedisMasters) -> None:
    runtime = Runtime(Settings(lock_url=masters.url, key_secret=SECRET, key_prefix="exec"))
    try:
        assert isinstance(runtime.backend, RedlockBackend)
        spec = JobSpec(name="t.job", key="job:1", fingerprint="fp", ttl=5.0, result_ttl=60.0)
        ran: list[int] = []

        def body(ctx: object) -> int:
            ran.append(1)
            return 42

        first = runtime.executor.run(spec, body)
        again = runtime.executor.run(spec, body)
        assert (first.status, first.value) == ("ran", 42)
        assert (again.status, again.value) == ("replayed", 42)
        assert ran == [1]
        record = runtime.backend.job_record("job:1")
        assert isinstance(record, JobRecord) and record.state == "DONE"
        assert record.fence == first.fence == again.fence
    finally:
        runtime.keeper.stop()
        runtime.backend.close()


def test_a_held_job_is_busy_for_another_delivery(
    masters: RedisMasters, backend: RedlockBackend
) -> None:
    lease = backend.begin("busy-job", 5.0, record=True, fingerprint="fp")
    assert isinstance(lease, Lease)
    other = RedlockBackend.from_url(masters.url, prefix="rl")
    try:
        got = other.begin("busy-job", 5.0, record=True, fingerprint="fp2")
        assert isinstance(got, Busy) and got.fingerprint == "fp" and 0 < got.ttl_left <= 5.0
    finally:
        other.close()
    assert lease.release()


def test_locks_list_inspect_and_release_work_on_redlock(masters: RedisMasters) -> None:
    backend = RedlockBackend.from_url(masters.url)  # the CLI's default prefix
    env = cli_env(masters)
    try:
        lease = backend.try_acquire("orders:7", 30.0)
        assert lease is not None
        listed = run_cli("locks", "list", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        rows = [row for row in json.loads(listed.stdout) if row["key"] == "orders:7"]
        assert rows and rows[0]["fence"] == lease.fence and rows[0]["pid"] == os.getpid()
        shown = run_cli("locks", "inspect", "orders:7", env=env)
        assert f"fence:          {lease.fence}" in shown.stdout
        assert lease.owner not in listed.stdout + shown.stdout
        done = run_cli("locks", "release", "orders:7", "--force", env=env)
        assert done.returncode == 0 and "released" in done.stdout, done.stdout + done.stderr
        assert backend.inspect("orders:7") is None
        assert not lease.release()
        after = backend.try_acquire("orders:7", 5.0)
        assert after is not None and after.fence > lease.fence
        assert after.release()
    finally:
        backend.close()


def test_masters_that_lost_their_scripts_get_them_again_in_line(
    masters: RedisMasters, backend: RedlockBackend
) -> None:
    first = backend.try_acquire("flush", 5.0)
    assert first is not None and first.release()
    for i in range(3):  # every master answers NOSCRIPT: a grant needs the reload on two
        admin = masters.client(i)
        admin.script_flush()
        admin.close()
    lease = backend.try_acquire("flush", 5.0)
    assert lease is not None and lease.fence > first.fence
    info = backend.inspect("flush")
    assert info is not None and info.fence == lease.fence
    assert lease.release()


def _pairs(backend: RedlockBackend, key: str, n: int) -> list[int]:
    fences = []
    for _ in range(n):
        lease = backend.try_acquire(key, 5.0)
        assert lease is not None and lease.release()
        fences.append(lease.fence)
    return fences


def _child_pairs(backend: RedlockBackend, go: Any, out: Any) -> None:
    try:
        go.wait(10)
        out.put(_pairs(backend, "forked-child", 200))
    except BaseException as exc:
        out.put(repr(exc))


def test_a_forked_child_opens_its_own_connections(backend: RedlockBackend) -> None:
    """Parent and child use the same backend object at the same time: had the child kept
    the parent's sockets, their replies would cross."""
    _pairs(backend, "forked-parent", 1)  # the parent's connections exist now
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child_pairs, args=(backend, go, out))
    child.start()
    go.set()
    mine = _pairs(backend, "forked-parent", 200)
    theirs = out.get(timeout=30)
    child.join(10)
    assert child.exitcode == 0 and isinstance(theirs, list), theirs
    for fences in (mine, theirs):
        assert len(fences) == 200 and fences == sorted(set(fences))


@pytest.mark.parametrize("fixed", [True, False], ids=["marked-master", "default-master-control"])
def test_a_waiter_listens_where_its_refusal_marked_the_lock(
    masters: RedisMasters, fixed: bool
) -> None:
    """A release signals only on the masters where a refused attempt marked the lock waited
    on. Master 0 (the default a waiter listens on) left unmarked, as when it ran the attempt
    after the release (CI once waited a release out there): the waiter must listen on a
    master that refused it. The control listens on the default and misses the release."""
    holder_client = RedlockBackend.from_url(masters.url, prefix="rl-mark")
    waiter = RedlockBackend.from_url(masters.url, prefix="rl-mark", socket_timeout=3.0)
    try:
        holder = holder_client.try_acquire("marked", 30.0)
        assert holder is not None
        masters.servers[0].pause()  # the refusal is decided by masters 1 and 2
        try:
            assert isinstance(waiter.attempt("marked", 5.0), Busy)
        finally:
            masters.servers[0].resume()
        name = waiter.keys.lock("marked")
        wait_for(lambda: masters.client(0).hget(name, "waiters"), 5.0)  # the late attempt
        masters.client(0).hdel(name, "waiters")  # ... as if it had come after the release
        if not fixed:
            waiter.wait_master("marked")  # forget the refusal: listen on the default
        assert holder.release()
        started = time.monotonic()
        waiter.wait_for_release("marked", 2.0)
        waited = time.monotonic() - started
        if fixed:
            assert waited < 1.0, f"the waiter missed the release ({waited:.2f}s)"
        else:
            assert waited >= 1.9, "the control should wait on the unmarked master"
    finally:
        holder_client.close()
        waiter.close()
