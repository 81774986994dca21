"""The etcd backend beyond the contract: URLs, whole-second TTLs, the process lease, waking."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from devstack.local_etcd import EtcdCluster
from jobfence.config import Settings, UnsafeSettings
from jobfence.config.urls import check_lock_url
from jobfence.locks import BackendUnavailable, Backoff, Lease, acquire, open_backend
from jobfence.locks.backends.etcd import (
    TXN_CHUNK,
    EtcdBackend,
    EtcdClusterBackend,
    parse_endpoints,
    txn_chunks,
)
from jobfence.locks.backends.etcd.gateway import b64
from jobfence.locks.clock import ManualClock
from tests.servers import free_port
from tests.worker.test_cli import REPO_ROOT


@pytest.fixture
def backend(etcd_url: str) -> Iterator[EtcdBackend]:
    b = EtcdBackend.from_url(etcd_url, prefix=f"t-{uuid.uuid4().hex[:8]}")
    yield b
    b.close()


def _lease_of(backend: EtcdBackend, key: str) -> str:
    """The etcd lease id the lock key sits on (read straight from the gateway)."""
    reply = backend.gateway.call("/v3/kv/range", {"key": b64(f"{backend.prefix}/lock/{key}")})
    return str(reply["kvs"][0]["lease"])


# --------------------------------------------------------------------------- URLs


def test_lock_urls_name_every_member_and_refuse_what_etcd_cannot_use() -> None:
    check_lock_url("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379", "JOBFENCE_LOCK_URL")
    assert parse_endpoints("etcd://a:1,b:2/") == ["a:1", "b:2"]
    bad = {
        "etcd://root@10.0.0.1:2379": "not user:password",
        "etcd://10.0.0.1:2379/jobs": "has a path",
        "etcd://10.0.0.1:2379?timeout=3": "option 'timeout'",
        "etcd://10.0.0.1:2379?password=hunter2-pw": "user-info",
        "etcd://10.0.0.1:2379,10.0.0.2": "is not host:port",
        "etcd://10.0.0.1:2379,:2380": "is not host:port",
    }
    for url, problem in bad.items():
        with pytest.raises(UnsafeSettings) as refused:
            check_lock_url(url, "JOBFENCE_LOCK_URL")
        assert problem in str(refused.value), url
        assert "hunter2-pw" not in str(refused.value)
        with pytest.raises(ValueError):
            parse_endpoints(url)


def test_several_members_make_a_backend_that_survives_the_loss_of_one() -> None:
    one = open_backend("etcd://127.0.0.1:2379")
    three = open_backend("etcd://127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379")
    try:
        assert type(one) is EtcdBackend and not one.capabilities.ha
        assert isinstance(three, EtcdClusterBackend) and three.capabilities.ha
        for b in (one, three):
            caps = b.capabilities
            assert caps.native_fencing and caps.durable_fence and caps.release_notify
    finally:
        one.close()
        three.close()


# --------------------------------------------------------------------------- leases


def test_ttls_are_whole_seconds_at_least_two_and_the_lease_reports_them(
    backend: EtcdBackend,
) -> None:
    for asked, granted in [(0.3, 2.0), (2.5, 3.0), (7.0, 7.0)]:
        lease = backend.try_acquire(f"ttl-{asked}", asked)
        assert lease is not None
        assert lease.ttl == granted
        assert lease.remaining() <= granted
        info = backend.inspect(lease.key)
        assert info is not None and 0 < info.ttl_left <= granted
        assert lease.release()


def test_a_grant_counts_from_the_process_leases_last_renewal(etcd_url: str) -> None:
    """Keys share the process lease, so a new key's deadline is that lease's, not later."""
    clock = ManualClock()
    backend = EtcdBackend.from_url(etcd_url, prefix=f"t-{uuid.uuid4().hex[:8]}", clock=clock)
    try:
        first = backend.try_acquire("first", 10.0)
        assert first is not None and first.deadline == pytest.approx(clock.now + 10.0)
        clock.advance(3.0)  # under REFRESH_FRACTION of 10 s: the lease is reused as it is
        second = backend.try_acquire("second", 10.0)
        assert second is not None
        assert second.deadline == first.deadline, "a later grant outlived the lease it sits on"
        assert _lease_of(backend, "first") == _lease_of(backend, "second")
        clock.advance(2.0)  # now 5 s old: renewed (kept alive) before the next grant
        third = backend.try_acquire("third", 10.0)
        assert third is not None and third.deadline == pytest.approx(clock.now + 10.0)
        assert _lease_of(backend, "third") == _lease_of(backend, "first")
        for lease in (first, second, third):
            assert lease.release()
    finally:
        backend.close()


def test_a_grant_after_the_process_lease_vanished_takes_a_new_one(backend: EtcdBackend) -> None:
    old = backend.try_acquire("old", 5.0)
    assert old is not None
    lease_id = _lease_of(backend, "old")
    backend.gateway.call("/v3/lease/revoke", {"ID": lease_id})  # as an expiry would

    new = backend.try_acquire("new", 5.0)  # the cached lease is gone: one more grant
    assert new is not None and new.fence > old.fence
    assert _lease_of(backend, "new") != lease_id
    assert backend.extend_many([old, new]) == [False, True]
    assert old.lost and not new.lost
    assert new.release()


def test_extending_with_another_ttl_moves_the_key_and_keeps_its_fence(
    backend: EtcdBackend,
) -> None:
    lease = backend.try_acquire("move", 3.0)
    assert lease is not None
    before = _lease_of(backend, "move")
    backend.extend(lease, 9.0)
    info = backend.inspect("move")
    assert info is not None and info.fence == lease.fence and info.ttl_left > 3.0
    assert _lease_of(backend, "move") != before
    assert backend.extend_many([lease]) == [True]
    assert lease.release()


def test_a_forked_child_takes_a_lease_of_its_own(backend: EtcdBackend) -> None:
    parent = backend.try_acquire("parent", 10.0)
    assert parent is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: same backend object, after fork
        try:
            child = backend.try_acquire("child", 10.0)
            os.write(write, json.dumps({"fence": child.fence if child else None}).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        got = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert got["fence"] is not None and got["fence"] > parent.fence
    assert _lease_of(backend, "child") != _lease_of(backend, "parent")
    assert parent.release()


def test_scan_reads_page_by_page_and_matches_the_glob(
    backend: EtcdBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobfence.locks.backends.etcd import inspection

    monkeypatch.setattr(inspection, "SCAN_PAGE", 3)
    held = [backend.try_acquire(f"scan:{i}", 10.0) for i in range(7)]
    other = backend.try_acquire("other:1", 10.0)
    assert all(held) and other is not None
    found = {i.key: i.fence for i in backend.scan("scan:*")}
    assert found == {le.key: le.fence for le in held if le is not None}
    assert [i.key for i in backend.scan("*:1")] == ["other:1", "scan:1"]
    for lease in [*held, other]:
        assert lease is not None and lease.release()


# --------------------------------------------------------------------------- waiting


class _MaxJitter(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return b


def test_a_waiter_wakes_when_the_holders_lease_runs_out(etcd_url: str) -> None:
    """No release ever comes: the watch sees etcd delete the key at the lease's expiry."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    holder = EtcdBackend.from_url(etcd_url, prefix=prefix)
    waiter = EtcdBackend.from_url(etcd_url, prefix=prefix)
    try:
        held = holder.try_acquire("expiring", 2.0)  # never extended
        assert held is not None
        started = time.monotonic()
        slow = Backoff(base=10.0, cap=10.0, rng=_MaxJitter())
        got = acquire(waiter, "expiring", ttl=5.0, timeout=20.0, backoff=slow)
        waited = time.monotonic() - started
        assert got.fence > held.fence
        # Woken by the deletion (etcd checks expiries every 0.5 s), not by the 10 s backoff.
        assert waited < 8.0, waited
        assert got.release()
    finally:
        holder.close()
        waiter.close()


# --------------------------------------------------------------------------- failures


def test_a_member_that_refuses_connections_is_skipped(etcd_url: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    url = etcd_url.replace("etcd://", f"etcd://{dead},", 1)
    backend = open_backend(url, prefix=f"t-{uuid.uuid4().hex[:8]}")
    try:
        assert backend.capabilities.ha
        lease = backend.try_acquire("failover", 5.0)
        assert lease is not None and lease.release()
    finally:
        backend.close()
    nobody = open_backend(f"etcd://{dead}", socket_timeout=0.5)
    try:
        with pytest.raises(BackendUnavailable):
            nobody.try_acquire("nobody", 5.0)
    finally:
        nobody.close()


class _ReplyEater:
    """A TCP forwarder to one etcd member whose replies can be swallowed: the request
    arrives and is applied, the answer never comes back (a reply lost on the way)."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.swallow = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if not (replies and self.swallow.is_set()):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def test_a_grant_whose_answer_was_lost_is_deleted_by_the_next_heartbeat(
    etcd_server: EtcdCluster, etcd_url: str
) -> None:
    """etcd applies a grant whose answer is lost: the client gives up, and nobody knows the
    owner token. The next keeper round deletes that key (it would otherwise live as long as
    the process keeps its lease alive for its other locks)."""
    eater = _ReplyEater(etcd_server.endpoints[0])
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    backend = EtcdBackend.from_url(f"etcd://{eater.endpoint}", prefix=prefix, socket_timeout=0.5)
    observer = EtcdBackend.from_url(etcd_url, prefix=prefix)
    try:
        kept = backend.try_acquire("kept", 10.0)
        assert kept is not None
        eater.swallow.set()
        with pytest.raises(BackendUnavailable):
            backend.try_acquire("orphan", 10.0)
        eater.swallow.clear()
        orphan = observer.inspect("orphan")
        assert orphan is not None, "the grant was not applied: no lost answer to test"
        assert backend.extend_many([kept]) == [True]
        assert observer.inspect("orphan") is None
        again = backend.try_acquire("orphan", 10.0)
        assert again is not None and again.fence > orphan.fence
    finally:
        backend.close()
        observer.close()
        eater.close()


# --------------------------------------------------------------------------- start-up checks


class _Conf:
    task_always_eager = False


def test_start_up_accepts_a_live_etcd_and_reports_a_dead_one(etcd_url: str) -> None:
    from jobfence.tasks import Runtime
    from jobfence.worker.checks import LOCK_SERVER_DOWN, check_lock_backend

    dead = f"etcd://127.0.0.1:{free_port()}"
    for url, down in [(etcd_url, False), (dead, True)]:
        runtime = Runtime(Settings(lock_url=url, key_secret="a-real-random-secret-0123456789ab"))
        try:
            findings = list(check_lock_backend(conf=_Conf(), runtime=runtime))
        finally:
            runtime.close()
        assert not [f for f in findings if f.refuse], findings
        assert [f.code for f in findings] == ([LOCK_SERVER_DOWN] if down else [])


def test_the_check_command_runs_on_an_etcd_lock_url(etcd_url: str, redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("JOBFENCE_")}
    # Locks on etcd; the broker and results on Redis (they cannot be derived from etcd://).
    env.update(JOBFENCE_LOCK_URL=etcd_url, JOBFENCE_BROKER_URL=redis_url,
               JOBFENCE_RESULT_BACKEND=redis_url)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "jobfence", "check"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "start-up checks: passed" in done.stdout
    assert "starting anyway" not in done.stdout  # reached: no "cannot reach" warning


def test_a_ttl_that_etcd_rounds_up_to_the_visibility_timeout_is_refused(etcd_url: str) -> None:
    from types import SimpleNamespace

    from jobfence.tasks import Runtime
    from jobfence.worker.checks import check_timeouts

    settings = Settings(lock_url=etcd_url, default_ttl=2.5, visibility_timeout=3.0,
                        socket_timeout=0.5, key_secret="r" * 40)  # fmt: skip
    runtime = Runtime(settings)
    conf = SimpleNamespace(broker_transport_options={"visibility_timeout": 3.0})
    try:
        (finding,) = check_timeouts(conf, runtime)
    finally:
        runtime.close()
    assert finding.refuse and finding.setting == "JOBFENCE_DEFAULT_TTL"
    assert "3s (asked 2.5s; the lock server grants whole seconds)" in finding.problem


def test_an_alarm_that_stops_writes_is_named(backend: EtcdBackend) -> None:
    assert backend.server_problems() == []
    member = backend.gateway.call("/v3/maintenance/status", {})["header"]["member_id"]
    alarm = {"action": "ACTIVATE", "memberID": member, "alarm": "NOSPACE"}
    backend.gateway.call("/v3/maintenance/alarm", alarm)
    try:
        (problem,) = backend.server_problems()
        assert "NOSPACE" in problem[0] and "alarm disarm" in problem[1]
    finally:
        backend.gateway.call("/v3/maintenance/alarm", {**alarm, "action": "DEACTIVATE"})
    assert backend.server_problems() == []


def test_threads_share_one_backend_without_mixing_answers(backend: EtcdBackend) -> None:
    """Connections are lent to one thread at a time: every thread gets its own answers."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for j in range(20):
                lease = backend.try_acquire(f"thread-{i}-{j}", 5.0)
                assert isinstance(lease, Lease) and lease.key == f"thread-{i}-{j}"
                info = backend.inspect(lease.key)
                assert info is not None and info.fence == lease.fence
                assert lease.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_an_admin_release_spares_a_grant_made_just_before_its_delete(
    backend: EtcdBackend, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another worker takes the key right before the admin's removing txn is sent (after
    any look): the txn compares the grant's create revision and removes nothing."""
    key = f"admin-{uuid.uuid4().hex[:8]}"
    judged = backend.try_acquire(key, 10.0)
    assert judged is not None
    other = EtcdBackend.from_url(etcd_url, prefix=backend.prefix)
    newer: list[Lease] = []
    send = backend._txn

    def regrant_then_send(what: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if what in ("release_grant", "force_release") and not newer:
            assert other.force_release(key)  # the judged lease ended; a worker took the key
            got = other.try_acquire(key, 10.0)
            assert got is not None
            newer.append(got)
        return send(what, *args, **kwargs)

    monkeypatch.setattr(backend, "_txn", regrant_then_send)
    try:
        assert backend.release_grant(key, judged.fence) is False
        assert newer, "the removing txn was never sent"
        held = backend.inspect(key)
        assert held is not None and held.fence == newer[0].fence, "the newer grant was removed"
        assert other.release(newer[0]) is True
    finally:
        other.close()


def test_an_extension_batch_names_each_key_once_per_txn() -> None:
    """etcd refuses a txn that names one key twice; a batch may hold a lost lease and the
    key's new one, so those go in successive txns, in order, each at most TXN_CHUNK long."""
    items = [("a", "old", 1), ("b", "x", 1), ("a", "new", 1), ("c", "y", 1)]
    assert txn_chunks(items) == [[0, 1], [2, 3]]
    many = [(f"k{i}", "o", 1) for i in range(TXN_CHUNK + 1)]
    assert [len(c) for c in txn_chunks(many)] == [TXN_CHUNK, 1]
    assert txn_chunks([]) == []
