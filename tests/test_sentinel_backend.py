"""Redis Sentinel beyond the contract: its URL, start-up checks, a demoted master, use by URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.local_sentinel import LocalSentinel
from devstack.redis_server import free_port
from jobfence.config import Settings, UnsafeSettings
from jobfence.config.urls import sentinel_target
from jobfence.locks import BackendUnavailable, JobRecord, LockBackend, open_backend
from jobfence.locks.backends.redis import protocol as redis_protocol
from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend
from jobfence.tasks import Runtime
from jobfence.tasks.executor import JobSpec
from jobfence.worker.checks import Finding, check_lock_backend
from tests.servers import wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
SECRET = "a-real-random-secret-0123456789abcdef"
EXAMPLE = "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/mymaster/0"


@pytest.fixture(scope="module")
def topology() -> Iterator[LocalSentinel]:
    """1 master, 2 replicas, 3 sentinels for the module; tests use keys of their own."""
    with LocalSentinel() as t:
        yield t


@pytest.fixture
def backend(topology: LocalSentinel) -> Iterator[RedisSentinelBackend]:
    topology.wait_ready()
    b = RedisSentinelBackend.from_url(topology.url, prefix="st")
    yield b
    b.close()


class _Conf:
    task_always_eager = False


def startup_findings(url: str) -> list[Finding]:
    runtime = Runtime(Settings(lock_url=url, key_secret=SECRET))
    try:
        return list(check_lock_backend(conf=_Conf(), runtime=runtime))
    finally:
        runtime.close()


# --------------------------------------------------------------------------- the URL


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+sentinel://h1:26379,h2:26379", "names no master"),
        ("redis+sentinel://h1:26379,h2:26379/", "names no master"),
        ("redis+sentinel://h1:26379,,h2:26379/m", "empty sentinel"),
        ("redis+sentinel://h1:x/m", "port 'x'"),
        ("redis+sentinel://h1:26379,h1:26379/m", "more than once"),
        ("redis+sentinel://h1:26379/m/zero", "database 'zero'"),
        ("redis+sentinel://h1:26379/m?socket_timeout=1", "does not take"),
    ],
)
def test_an_unusable_sentinel_url_is_refused_naming_the_variable(url: str, problem: str) -> None:
    with pytest.raises(UnsafeSettings) as refused:
        Settings(lock_url=url, key_secret=SECRET)
    text = str(refused.value)
    assert "JOBFENCE_LOCK_URL" in text and problem in text, text
    assert EXAMPLE in text or "once" in text


def test_the_sentinel_url_names_sentinels_master_db_and_credentials() -> None:
    target = sentinel_target("redis+sentinel://u:s3%2Fcret@h1:26380,h2,[::1]:26381/my%20master/3")
    assert target.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 26381))
    assert (target.service, target.db, target.username, target.password) == (
        "my master", 3, "u", "s3/cret",
    )  # fmt: skip
    assert "s3" not in repr(target)
    with pytest.raises(UnsafeSettings) as refused:
        sentinel_target("redis+sentinel://u:s3cret@h1:1")
    assert "s3cret" not in str(refused.value)


def test_open_backend_builds_a_sentinel_backend_from_the_url(topology: LocalSentinel) -> None:
    backend = open_backend(topology.url, prefix="st", socket_timeout=0.5)
    try:
        assert isinstance(backend, RedisSentinelBackend)
        assert backend.name == "redis-sentinel" and backend.service == "jfmaster"
        caps = backend.capabilities
        assert caps.ha and caps.native_fencing and caps.durable_fence and caps.release_notify
        assert backend.master_address()[1] == topology.master().port
    finally:
        backend.close()


# --------------------------------------------------------------------------- start-up checks


def test_a_sound_topology_passes_the_start_up_checks(topology: LocalSentinel) -> None:
    topology.wait_ready()
    assert startup_findings(topology.url) == []


@pytest.mark.parametrize("node", ["master", "replica"])
def test_an_evicting_master_or_replica_is_refused(topology: LocalSentinel, node: str) -> None:
    topology.wait_ready()
    server = topology.master() if node == "master" else topology.replicas()[1]
    admin = server.client()
    admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        refused = [f for f in startup_findings(topology.url) if f.refuse]
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
    assert len(refused) == 1 and "allkeys-lru" in refused[0].problem
    assert refused[0].setting == "JOBFENCE_LOCK_URL"
    assert ("promoted on failover" in refused[0].problem) == (node == "replica")


def test_no_replica_and_one_sentinel_are_warned_about_not_refused() -> None:
    with LocalSentinel(replicas=0, sentinels=1) as lone:
        findings = startup_findings(lone.url)
    assert findings and not [f for f in findings if f.refuse]
    problems = " | ".join(f.problem for f in findings)
    assert "no live replica" in problems and "only 1 sentinel(s)" in problems


def test_unreachable_sentinels_are_warned_about_and_start_up_goes_on() -> None:
    (finding,) = startup_findings(f"redis+sentinel://127.0.0.1:{free_port()}/jfmaster")
    assert not finding.refuse and "name no master" in finding.problem


# --------------------------------------------------------------------------- failover


def test_a_chunked_extension_reloads_a_flushed_script_on_the_master(
    topology: LocalSentinel, backend: RedisSentinelBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extend_many of more leases than a script takes: several scripts in one write, and a
    NOSCRIPT to them (the master's cache emptied) loads the script and sends them again."""
    monkeypatch.setattr(redis_protocol, "EXTEND_CHUNK", 3)
    leases = [backend.try_acquire(f"chunked:{i}", 30.0) for i in range(7)]
    held = [le for le in leases if le is not None]
    assert len(held) == 7 and backend.extend_many(held) == [True] * 7
    admin = topology.master().client()
    try:
        admin.script_flush()
        assert backend.extend_many(held) == [True] * 7
    finally:
        admin.close()
    assert all(le.release() for le in held)


def test_a_demoted_master_is_unavailable_never_not_the_owner(
    topology: LocalSentinel, backend: RedisSentinelBackend
) -> None:
    """A master turned replica answers READONLY: the lease is not lost, the call is retried."""
    lease = backend.try_acquire("demoted", 30.0)
    assert lease is not None
    old, other = topology.master(), topology.replicas()[0]
    # Replicated first: the demoted master's full resync from `other` must not lose it.
    assert old.client().execute_command("WAIT", 2, 5000) == 2
    admin = old.client()
    admin.replicaof(other.host, other.port)  # behind the sentinels' back: they still name it
    try:
        with pytest.raises(BackendUnavailable) as refused:
            backend.extend_many([lease])
        assert "previous master is now a slave" in str(refused.value.cause)
        with pytest.raises(BackendUnavailable):
            backend.try_acquire("demoted-2", 5.0)
        assert not lease.lost
    finally:
        admin.replicaof("NO", "ONE")
        admin.close()
        for node in topology.replicas():  # back under the old master, as before
            node.client().replicaof(old.host, old.port)
        topology.wait_ready()
    assert backend.extend_many([lease]) == [True]
    assert lease.release()


def test_the_backend_follows_a_failover_to_the_new_master(
    topology: LocalSentinel, backend: RedisSentinelBackend
) -> None:
    topology.wait_ready()
    lease = backend.try_acquire("follow", 30.0)
    assert lease is not None
    topology.master().client().execute_command("WAIT", 2, 2000)  # replicated: it survives
    old = topology.master()
    sentinel = topology.sentinels[0].client()
    try:
        assert sentinel.execute_command("SENTINEL", "FAILOVER", topology.service)
    finally:
        sentinel.close()
    new = topology.wait_for_failover(old)

    def extended() -> bool:
        try:
            return backend.extend_many([lease]) == [True]
        except BackendUnavailable:
            return False

    wait_for(lambda: backend.master_address()[1] == new.port, timeout=10.0,
             message="the sentinels never agreed on the new master")  # fmt: skip
    wait_for(extended, timeout=10.0, message="the lease was never extended on the new master")
    assert new.client(decode_responses=True).pttl(backend.keys.lock("follow")) > 25_000
    info = backend.inspect("follow")
    assert info is not None and info.fence == lease.fence
    after = backend.try_acquire("follow-2", 5.0)
    assert after is not None and after.fence > lease.fence
    assert lease.release() and after.release()
    topology.rejoin(old)  # the deposed master as a replica, for the tests after this one


# --------------------------------------------------------------------------- above the backend


def test_the_executor_runs_a_job_once_through_the_url_alone(topology: LocalSentinel) -> None:
    runtime = Runtime(Settings(lock_url=topology.url, key_secret=SECRET, key_prefix="exec"))
    try:
        assert isinstance(runtime.backend, RedisSentinelBackend)
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
    finally:
        runtime.close()


def run_cli(*args: str, topology: LocalSentinel) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("JOBFENCE_")}
    master = topology.master()  # broker and results cannot be derived from a sentinel URL
    env.update(
        JOBFENCE_LOCK_URL=topology.url,
        JOBFENCE_KEY_SECRET=SECRET,
        JOBFENCE_BROKER_URL=master.db_url(1),
        JOBFENCE_RESULT_BACKEND=master.db_url(2),
    )
    return subprocess.run([sys.executable, "-m", "jobfence", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_cli_lists_inspects_and_releases_sentinel_locks(topology: LocalSentinel) -> None:
    topology.wait_ready()
    backend: LockBackend = RedisSentinelBackend.from_url(topology.url)  # the CLI's prefix
    try:
        lease = backend.try_acquire("orders:7", 30.0)
        assert lease is not None
        listed = run_cli("locks", "list", "--json", topology=topology)
        assert listed.returncode == 0, listed.stderr
        rows = [row for row in json.loads(listed.stdout) if row["key"] == "orders:7"]
        assert rows and rows[0]["fence"] == lease.fence
        done = run_cli("locks", "release", "orders:7", "--force", topology=topology)
        assert done.returncode == 0 and "released" in done.stdout, done.stdout + done.stderr
        assert backend.inspect("orders:7") is None and not lease.release()
        checked = run_cli("check", topology=topology)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        backend.close()
