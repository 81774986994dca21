"""A clean `SENTINEL FAILOVER` while a job's lease is held and renewed: one holder, one effect.

After the sentinels promote a replica, the old master stays a writable master until their
next INFO round demotes it (about 10 s). A holder whose renewals go on landing there keeps
its lease while the key expires on the new master, where another worker is then granted the
same job: two holders, both fenced effects accepted. The holder must follow the sentinels:
its lease is confirmed on the new master (then the rival is refused) or lost at once.
The control holds the lease through connections fixed on the old master, as a client that
never asks the sentinels again does: the rival is granted while the old holder still holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from devstack.local_sentinel import LocalSentinel
from devstack.redis_server import RedisServer
from jobfence.locks import Lease, LeaseKeeper, LeaseLost, RedisFenceGuard
from jobfence.locks.aio import AsyncLocker
from jobfence.locks.backend import JobRecord, LockBackend
from jobfence.locks.backends.redis import RedisBackend, sentinel_watch
from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend
from jobfence.locks.errors import BackendUnavailable
from tests.servers import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.slow]

PREFIX = "scf"
TTL = 1.5
#: How long the rival keeps asking after the promotion: the key expires on the new master
#: within one TTL unless the holder renews it there; the old master stays a master ~10 s.
WATCH = 4 * TTL


@pytest.fixture
def topology() -> Iterator[LocalSentinel]:
    """A topology of this test's own: it fails over."""
    with LocalSentinel() as t:
        yield t


def sentinel_backend(topology: LocalSentinel) -> RedisSentinelBackend:
    return RedisSentinelBackend.from_url(topology.url, prefix=PREFIX, socket_timeout=1.0)


def fail_over(topology: LocalSentinel) -> RedisServer:
    """A clean failover: everything replicated, then SENTINEL FAILOVER; the old master."""
    old = topology.master()
    admin = old.client()
    try:
        assert admin.execute_command("WAIT", len(topology.nodes) - 1, 5000) >= 1
    finally:
        admin.close()
    sentinel = topology.sentinels[0].client()
    try:
        assert sentinel.execute_command("SENTINEL", "FAILOVER", topology.service)
    finally:
        sentinel.close()
    new = topology.wait_for_failover(old)

    def all_agree() -> bool:  # every sentinel's table names it: a worker started now uses it
        for s in topology.sentinels:
            client = s.client()
            try:
                state: Any = client.sentinel_master(topology.service)
            finally:
                client.close()
            if int(state["port"]) != new.port:
                return False
        return True

    wait_for(all_agree, timeout=20.0, message="the sentinels never agreed on the new master")
    return old


def is_master(node: RedisServer) -> bool:
    client = node.client(socket_timeout=1.0, decode_responses=True)
    try:
        return bool(client.info("replication").get("role") == "master")
    finally:
        client.close()


def contend(rival: LockBackend, key: str, holder: Lease, old: RedisServer) -> Lease | None:
    """Ask for `key` on the new master for WATCH seconds; the rival's lease if granted."""
    deadline = time.monotonic() + WATCH
    while time.monotonic() < deadline:
        try:
            got = rival.begin(key, TTL, record=True)
        except BackendUnavailable:
            got = None
        if isinstance(got, Lease):
            return got
        assert not isinstance(got, JobRecord)
        time.sleep(0.05)  # a retry interval, not a synchronisation
    return None


def run_effects(holders: list[Lease | None], guard: RedisFenceGuard) -> None:
    """Each holder in turn, the old one first: if its lease still holds, the fenced effect
    and the DONE record (the job's body and commit)."""
    for i, lease in enumerate(holders):
        if lease is None:
            continue
        try:
            lease.check()
        except LeaseLost:
            continue
        guard.write("job", lease.fence, [("INCR", "effects")], write_id=f"run-{i}")
        lease.backend.commit(lease, state="DONE", result="1", fingerprint="", result_ttl=60.0)


def test_a_clean_failover_leaves_one_holder_and_applies_the_effect_once(
    topology: LocalSentinel, fresh_redis: RedisServer
) -> None:
    holder_backend = sentinel_backend(topology)
    rival_backend: RedisSentinelBackend | None = None
    keeper = LeaseKeeper()
    store = fresh_redis.client(decode_responses=True)
    guard = RedisFenceGuard(store, prefix="res")
    try:
        lease = holder_backend.begin("job:1", TTL, record=True)
        assert isinstance(lease, Lease)
        keeper.keep(lease)
        old = fail_over(topology)
        rival_backend = sentinel_backend(topology)  # a worker started after the promotion
        rival = contend(rival_backend, "job:1", lease, old)
        two = rival is not None and lease.held
        assert not two, "two holders: the old one renewed on the old master"
        run_effects([lease, rival], guard)
        assert store.get("effects") == "1"
        after = rival_backend.begin("job:1", TTL, record=True)
        assert isinstance(after, JobRecord) and after.state == "DONE"
    finally:
        keeper.stop()
        holder_backend.close()
        if rival_backend is not None:
            rival_backend.close()


def test_with_asyncio_a_clean_failover_leaves_one_holder(topology: LocalSentinel) -> None:
    async def scenario() -> tuple[bool, bool]:
        locker = AsyncLocker.from_url(topology.url, prefix=PREFIX, socket_timeout=1.0)
        try:
            lease = await locker.acquire("job:2", ttl=TTL, blocking=False)
            old = await asyncio.to_thread(fail_over, topology)
            rival_backend = sentinel_backend(topology)  # a worker started after it
            try:
                rival = await asyncio.to_thread(contend, rival_backend, "job:2", lease, old)
            finally:
                rival_backend.close()
            return rival is not None, lease.held
        finally:
            await locker.aclose()

    granted, held = asyncio.run(scenario())
    assert not (granted and held), "two holders: the asyncio holder renewed on the old master"
    assert granted or held  # the job has a holder: the rival, or the confirmed lease


def test_control_a_holder_left_on_the_old_master_overlaps_the_rival(
    topology: LocalSentinel,
) -> None:
    """The same failover, the holder's store fixed on the old master (as connections made
    before the promotion are): the rival is granted on the new master while it still holds,
    and the old master still takes its renewals."""
    old_node = topology.master()
    naive = RedisBackend.from_url(f"redis://{old_node.host}:{old_node.port}/0", prefix=PREFIX,
                                  socket_timeout=1.0)  # fmt: skip
    rival_backend: RedisSentinelBackend | None = None
    keeper = LeaseKeeper()
    try:
        lease = naive.begin("job:3", TTL, record=True)
        assert isinstance(lease, Lease)
        keeper.keep(lease)
        old = fail_over(topology)
        rival_backend = sentinel_backend(topology)
        rival = contend(rival_backend, "job:3", lease, old)
        assert rival is not None and lease.held, "no overlap: the control proves nothing"
        assert is_master(old)  # ... while the old master is still a writable master
    finally:
        keeper.stop()
        naive.close()
        if rival_backend is not None:
            rival_backend.close()


def test_a_lease_the_new_master_does_not_hold_is_lost_once_the_change_is_seen(
    topology: LocalSentinel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder's backend learns of the change only when asked (its watch made slow), after
    the rival was granted on the new master: the lease is lost then, not at the demotion."""
    monkeypatch.setattr(sentinel_watch, "MASTER_POLL", 3600.0)
    monkeypatch.setattr(sentinel_watch, "MASTER_MAX_AGE", 3600.0)
    holder_backend = sentinel_backend(topology)
    rival_backend: RedisSentinelBackend | None = None
    try:
        lease = holder_backend.try_acquire("job:4", 30.0)
        assert lease is not None
        old = fail_over(topology)
        admin = topology.master().client()
        try:  # stands in for the key's expiry there while renewals went to the old master
            admin.delete(holder_backend.keys.lock("job:4"))
        finally:
            admin.close()
        rival_backend = sentinel_backend(topology)
        rival = rival_backend.try_acquire("job:4", 30.0)
        assert rival is not None and lease.held
        holder_backend.watch.poll()
        with pytest.raises(LeaseLost):
            lease.check()
        assert is_master(old)  # at once: the old master is not demoted yet
        assert rival.held and rival.release()
    finally:
        holder_backend.close()
        if rival_backend is not None:
            rival_backend.close()
