"""The ZooKeeper backend beyond the contract: URLs, session TTLs, fences, round trips, sessions."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from kazoo.client import KazooClient

from devstack.local_zookeeper import ZooKeeperServer
from jobfence.config import UnsafeSettings
from jobfence.config.urls import check_lock_url
from jobfence.locks import (
    BackendUnavailable,
    Busy,
    JobRecord,
    Lease,
    LeaseLost,
    LockError,
    open_backend,
)
from jobfence.locks.backends.zookeeper import ZooKeeperBackend, node_name, parse_url
from tests.servers import wait_for


@pytest.fixture
def backend(zookeeper_url: str) -> Iterator[ZooKeeperBackend]:
    b = open_backend(zookeeper_url, prefix="unit", socket_timeout=2.0)
    assert isinstance(b, ZooKeeperBackend)
    yield b
    b.close()


@pytest.fixture
def raw(zookeeper_server: ZooKeeperServer) -> Iterator[KazooClient]:
    """A plain kazoo client on the server, no chroot: to read what the backend wrote."""
    client = KazooClient(zookeeper_server.address, timeout=5.0)
    client.start(timeout=10)
    yield client
    client.stop()
    client.close()


def _key() -> str:
    return f"unit:{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- URLs


def test_url_names_hosts_and_chroot() -> None:
    assert parse_url("zookeeper://a:1,b:2,c/x/y") == ("a:1,b:2,c:2181", "/x/y")
    assert parse_url("zookeeper://a:1/") == ("a:1", "")
    for bad in ("zookeeper://a:x", "zookeeper://:p@a:1", "zookeeper://u@a:1",
                "zookeeper://a:1/x//y", "zookeeper://a:1?timeout=3", "redis://a:1"):  # fmt: skip
        with pytest.raises(ValueError):
            parse_url(bad)
    with pytest.raises(LockError, match="needs a user and a password") as refused:
        open_backend("zookeeper://:secret@a:1")
    assert "secret" not in str(refused.value)


def test_settings_check_names_the_bad_part_of_a_zookeeper_url() -> None:
    check_lock_url("zookeeper://zk1:2181,zk2:2181,zk3:2181/jobfence", "JOBFENCE_LOCK_URL")
    with pytest.raises(UnsafeSettings, match=r"port 'x' in 'zk2:x'"):
        check_lock_url("zookeeper://zk1:2181,zk2:x/jobfence", "JOBFENCE_LOCK_URL")
    with pytest.raises(UnsafeSettings, match="no host"):
        check_lock_url("zookeeper://:2181", "JOBFENCE_LOCK_URL")
    check_lock_url("zookeeper://admin:hunter2@zk1:2181/x?use_ssl=true", "JOBFENCE_LOCK_URL")
    for bad in ("zookeeper://:hunter2@zk1:2181", "zookeeper://admin:hunter2@zk1:2181?pw=1"):
        with pytest.raises(UnsafeSettings) as refused:
            check_lock_url(bad, "JOBFENCE_LOCK_URL")
        assert "hunter2" not in str(refused.value)


def test_a_prefix_that_is_no_node_name_is_refused() -> None:
    with pytest.raises(LockError, match="JOBFENCE_KEY_PREFIX"):
        ZooKeeperBackend.from_url("zookeeper://127.0.0.1:1", prefix="a/b")


# --------------------------------------------------------------------------- TTL = session timeout


def test_a_lease_reports_the_session_timeout_the_server_grants(
    backend: ZooKeeperBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jobfence.locks.backends.zookeeper")
    exact = backend.try_acquire(_key(), 2.5)
    assert exact is not None and exact.ttl == 2.5
    # The test server's minSessionTimeout is 1 s: a 0.3 s lease lasts 1 s, and says so.
    short = backend.try_acquire(_key(), 0.3)
    assert short is not None and short.ttl == 1.0
    assert short.remaining() > 0.5
    assert "granted a session timeout of 1s for a lease TTL of 0.3s" in caplog.text
    # extend() keeps the session's TTL whatever it is asked for: the server would not know.
    backend.extend(short, 30.0)
    assert short.ttl == 1.0 and short.remaining() <= 1.0


def test_server_problems_name_ttls_the_server_would_stretch(backend: ZooKeeperBackend) -> None:
    assert backend.server_problems([2.0, 30.0]) == []
    (problem, fix), = backend.server_problems([0.5])
    assert "at least 1s" in problem and "0.5s" in problem
    assert "minSessionTimeout" in fix
    assert backend._sessions == {}, "the probe left sessions open in a process about to fork"


# --------------------------------------------------------------------------- fences and node data


def test_fence_is_the_deployment_base_plus_the_lock_nodes_czxid(
    backend: ZooKeeperBackend, raw: KazooClient
) -> None:
    key = _key()
    lease = backend.try_acquire(key, 5.0)
    assert lease is not None
    data, base = raw.get(f"{backend.root}/fence-base")
    _, lock = raw.get(f"{backend.root}/locks/{node_name(key)}")
    assert int(data) == base.ctime * 1000  # the base says in µs what its ctime says in ms
    assert lease.fence == base.ctime * 1000 + lock.czxid
    assert lease.fence > time.time() * 1e6 - 3600e6  # in the common µs fence space


def test_lock_node_keeps_the_key_and_holder_but_never_the_owner_token(
    backend: ZooKeeperBackend, raw: KazooClient
) -> None:
    key = _key()
    lease = backend.try_acquire(key, 5.0)
    assert lease is not None
    data, stat = raw.get(f"{backend.root}/locks/{node_name(key)}")
    holder = json.loads(data)
    assert holder["key"] == key and holder["pid"] == os.getpid()
    assert lease.owner not in data.decode()
    assert stat.ephemeralOwner != 0  # it dies with its session
    assert backend.commit(lease, state="DONE", result='"r"', fingerprint="fp", result_ttl=60)
    record, _ = raw.get(f"{backend.root}/keys/{node_name(key)[:2]}/{node_name(key)}/job")
    assert lease.owner not in record.decode()


# --------------------------------------------------------------------------- round trips


def test_each_call_is_one_request(backend: ZooKeeperBackend) -> None:
    backend.try_acquire(_key(), 5.0)  # connects, makes the prefix's nodes, reads the base

    def requests(call: object) -> int:
        before = backend.requests
        assert callable(call)
        call()
        return backend.requests - before

    key = _key()
    got: list[Lease] = []
    assert requests(lambda: got.append(backend.begin(key, 5.0, record=True))) == 1  # new key
    lease = got.pop()
    assert requests(lambda: backend.commit(lease, state="DONE", result="1", fingerprint="",
                                           result_ttl=60)) == 1  # fmt: skip
    key = _key()
    assert requests(lambda: got.append(backend.try_acquire(key, 5.0))) == 1
    assert requests(lambda: got[0].release()) == 1
    assert requests(lambda: got.append(backend.try_acquire(key, 5.0))) == 1  # known key
    leases = [got[1], *(backend.try_acquire(_key(), 5.0) for _ in range(3))]
    assert all(leases)
    assert requests(lambda: backend.extend_many(leases)) == 1  # type: ignore[arg-type]


def test_extend_many_with_a_lost_lease_costs_one_more_multi(backend: ZooKeeperBackend) -> None:
    leases = [backend.try_acquire(_key(), 5.0) for _ in range(3)]
    assert all(isinstance(le, Lease) for le in leases)
    assert backend.force_release(leases[1].key)  # type: ignore[union-attr]
    before = backend.requests
    assert backend.extend_many(leases) == [True, False, True]  # type: ignore[arg-type]
    assert backend.requests - before == 2  # all or nothing: again without the lost one


def test_done_record_answers_a_job_grant_in_two_requests(backend: ZooKeeperBackend) -> None:
    key = _key()
    lease = backend.begin(key, 5.0, record=True, fingerprint="fp")
    assert isinstance(lease, Lease)
    assert backend.commit(lease, state="DONE", result="7", fingerprint="fp", result_ttl=60)
    before = backend.requests
    again = backend.begin(key, 5.0, record=True, fingerprint="fp")
    assert isinstance(again, JobRecord) and again.result == "7"
    assert backend.requests - before == 2  # the probe found a record; one read of it


# --------------------------------------------------------------------------- sessions


def _end_session(server: ZooKeeperServer, lease: Lease) -> None:
    """Close the lease's session on the server, as an expiry would (kazoo connects with its
    id and closes it: the owner's connection is dropped, its ephemeral nodes deleted)."""
    backend = lease.backend
    assert isinstance(backend, ZooKeeperBackend)
    grant = backend._grants[(lease.key, lease.owner)]
    client = grant.session.client
    thief = KazooClient(server.address, timeout=5.0, client_id=client.client_id)
    thief.start(timeout=10)
    thief.stop()
    thief.close()


def test_an_ended_session_marks_its_leases_lost_and_frees_their_locks(
    backend: ZooKeeperBackend, zookeeper_server: ZooKeeperServer, zookeeper_url: str
) -> None:
    key = _key()
    lease = backend.try_acquire(key, 10.0)
    assert lease is not None
    causes: list[BaseException] = []
    lease.on_lost(lambda _le, cause: causes.append(cause))
    _end_session(zookeeper_server, lease)

    wait_for(lambda: lease.lost, 10.0, message="the lease outlived its session")
    assert isinstance(causes[0], LeaseLost) and "session ended" in str(causes[0])
    other = open_backend(zookeeper_url, prefix="unit")
    try:
        newer = other.try_acquire(key, 10.0)
        assert newer is not None and newer.fence > lease.fence  # at once, not after a TTL
        assert lease.release() is False
        assert other.inspect(key) is not None
        # The backend reconnects with a new session of its own.
        def fresh() -> Lease | None:
            try:
                return backend.try_acquire(_key(), 10.0)
            except BackendUnavailable:  # not yet reconnected
                return None

        again = wait_for(fresh, 10.0, interval=0.05)
        assert again.release()
    finally:
        other.close()


def test_a_forked_child_opens_its_own_session_and_leaves_the_parents_alone(
    backend: ZooKeeperBackend, raw: KazooClient
) -> None:
    key = _key()
    lease = backend.try_acquire(key, 5.0)
    assert lease is not None
    parent_session = backend._grants[(key, lease.owner)].session.sid
    pid = os.fork()
    if pid == 0:  # the child: the same backend object, a session of its own
        code = 1
        try:
            mine = backend.try_acquire(key + ":child", 5.0)
            theirs = backend.release(lease)  # not the child's lease to free
            if mine is not None and mine.release() and theirs is False:
                code = 0
            backend.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _, stat = raw.get(f"{backend.root}/locks/{node_name(key)}")
    assert stat.ephemeralOwner == parent_session
    backend.extend(lease)
    assert lease.held and lease.release()


def _answered(ask: Callable[[], bool]) -> bool:
    """`ask()`, False where the server did not answer within the backend's timeout."""
    try:
        return ask()
    except BackendUnavailable:
        return False


def test_a_grant_whose_answer_was_lost_is_deleted_by_its_process(tmp_path: object) -> None:
    with ZooKeeperServer() as server:
        # A short timeout, so the paused grant gives up soon; on a loaded machine the first
        # set-up may miss it too (a full run: "zookeeper setup failed"), so it is retried.
        backend = ZooKeeperBackend.from_url(server.url, prefix="orphan", socket_timeout=0.3)
        try:
            key = _key()
            wait_for(lambda: _answered(lambda: backend.try_acquire(_key(), 10.0) is not None),
                     30.0, interval=0.1, message="no first grant")  # connected, nodes made
            server.pause()  # the grant reaches the server's socket; its answer comes late
            try:
                with pytest.raises(BackendUnavailable):
                    backend.try_acquire(key, 10.0)
            finally:
                server.resume()
            # The node was made for a lease nobody holds; its process deletes it.
            wait_for(lambda: _answered(lambda: backend.inspect(key) is None), 10.0,
                     interval=0.05, message="the orphaned lock node stayed")  # fmt: skip
            wait_for(lambda: _answered(lambda: backend.try_acquire(key, 10.0) is not None),
                     30.0, interval=0.1, message="the key was not granted again")  # fmt: skip
        finally:
            backend.close()


def test_a_fence_not_above_one_from_lost_data_is_refused(backend: ZooKeeperBackend) -> None:
    key = _key()
    first = backend.try_acquire(key, 5.0)
    assert first is not None and first.release()
    backend._old_floor = first.fence + 10**12  # as if earlier data had reached this far
    with pytest.raises(BackendUnavailable, match="data was lost"):
        backend.try_acquire(key, 5.0)
    wait_for(lambda: backend.inspect(key) is None, 5.0, message="the refused grant's node stayed")


def test_a_lock_node_nobody_extends_goes_after_its_ttl_though_its_session_lives(
    backend: ZooKeeperBackend, raw: KazooClient, zookeeper_url: str
) -> None:
    """A node no lease holds (its process's reaper gone, say) is deleted by the next
    contender once the server's clock is well past its TTL; a node kept alive is not."""
    key, kept = _key(), _key()
    assert backend.try_acquire(_key(), 5.0) is not None  # the prefix's nodes exist
    stray = json.dumps({"key": key, "ttl_ms": 1000, "task_id": "gone"}).encode()
    raw.create(f"{backend.root}/locks/{node_name(key)}", stray, ephemeral=True)
    alive = backend.try_acquire(kept, 1.0)
    assert alive is not None and alive.ttl == 1.0
    other = open_backend(zookeeper_url, prefix="unit")
    try:
        assert isinstance(other.attempt(key, 5.0), Busy)
        started = time.monotonic()
        while time.monotonic() - started < 2.5:  # TTL 1 s + the margin, while extending
            backend.extend(alive)
            assert isinstance(other.attempt(kept, 5.0), Busy), "took an extended lease"
            time.sleep(0.2)
        taken = wait_for(lambda: other.try_acquire(key, 5.0), 5.0, interval=0.1)
        assert taken.fence > 0 and raw.exists(f"{backend.root}/locks/{node_name(key)}")
    finally:
        other.close()


# --------------------------------------------------------------------------- housekeeping


def test_prune_removes_expired_records_and_idle_key_nodes(
    zookeeper_url: str, raw: KazooClient
) -> None:
    backend = ZooKeeperBackend.from_url(zookeeper_url, prefix="prune", fence_retention=0.5)
    try:
        gone, kept = _key(), _key()
        for key, ttl in ((gone, 0.2), (kept, 600.0)):
            lease = backend.begin(key, 5.0, record=True)
            assert isinstance(lease, Lease)
            assert backend.commit(lease, state="DONE", result="1", fingerprint="", result_ttl=ttl)
        time.sleep(0.6)  # past the short record's TTL and the key node's retention
        assert backend.prune(force=True) == 2  # the record, then its idle key node
        keys = f"{backend.root}/keys"
        assert not raw.exists(f"{keys}/{node_name(gone)[:2]}/{node_name(gone)}")
        assert backend.job_record(kept) is not None
        assert backend.prune() is not None  # the first turn of this prefix
        assert backend.prune() is None  # another pass ran within the interval
        # A grant on a pruned key makes its key node again, with a higher fence.
        assert backend.try_acquire(gone, 5.0) is not None
    finally:
        backend.close()


# --------------------------------------------------------------------------- start-up checks


class _Conf:
    task_always_eager = False


def test_start_up_refuses_a_ttl_the_server_would_stretch_and_reports_a_dead_server(
    zookeeper_url: str,
) -> None:
    from jobfence.config import Settings
    from jobfence.tasks import Runtime
    from jobfence.worker.checks import LOCK_SERVER_DOWN, check_lock_backend

    cases = [
        (zookeeper_url, 2.0, []),
        (zookeeper_url, 0.5, ["refuse"]),  # the test server's minSessionTimeout is 1 s
        ("zookeeper://127.0.0.1:1", 2.0, [LOCK_SERVER_DOWN]),
    ]
    for url, ttl, expected in cases:
        settings = Settings(lock_url=url, default_ttl=ttl, heartbeat_fraction=0.3,
                            socket_timeout=0.2, key_secret="r" * 40)  # fmt: skip
        runtime = Runtime(settings)
        try:
            findings = list(check_lock_backend(conf=_Conf(), runtime=runtime))
        finally:
            runtime.close()
        assert [("refuse" if f.refuse else f.code) for f in findings] == expected, findings
        if expected == ["refuse"]:
            assert "JOBFENCE_LOCK_URL" in findings[0].setting
            assert "0.5s" in findings[0].problem and "minSessionTimeout" in findings[0].fix
