"""Redis Cluster backend: per-node heartbeats, scans of every node, the guard, one slot a script."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from redis.crc import key_slot

from devstack.local_cluster import LocalCluster
from jobfence.config import UnsafeSettings
from jobfence.config.urls import cluster_nodes
from jobfence.locks import FencedWriteRefused, Lease, RedisFenceGuard, StaleFence, open_backend
from jobfence.locks.backends.redis import cluster_heartbeat
from jobfence.locks.backends.redis.cluster import RedisClusterBackend
from jobfence.locks.slots import SlotLease
from jobfence.worker.admin import release_grant
from tests.servers import wait_for

SCRIPT_CALLS = ("cmdstat_evalsha", "cmdstat_eval")
SECRET = "cluster-test-" + "k" * 32


@pytest.fixture
def backend(redis_cluster: LocalCluster) -> Iterator[RedisClusterBackend]:
    b = RedisClusterBackend.from_url(redis_cluster.url, prefix=f"rc-{uuid.uuid4().hex[:8]}")
    yield b
    b.close()


def _script_calls(cluster: LocalCluster) -> list[int]:
    out = []
    for server in cluster.masters:
        stats = server.client(decode_responses=True).info("commandstats")
        out.append(sum(int(v["calls"]) for k, v in stats.items() if k in SCRIPT_CALLS))
    return out


def _keys_on_every_node(cluster: LocalCluster, backend: RedisClusterBackend, n: int) -> list[str]:
    keys = [f"job:{i}" for i in range(n)]
    nodes = {cluster.node_of(backend.keys.lock(k)) for k in keys}
    assert nodes == {0, 1, 2}, "the keys should land on every master"
    return keys


def test_extend_many_sends_one_script_to_each_node(
    redis_cluster: LocalCluster, backend: RedisClusterBackend
) -> None:
    keys = _keys_on_every_node(redis_cluster, backend, 30)
    leases = [backend.try_acquire(k, 3.0) for k in keys]
    assert all(leases)
    held = [le for le in leases if le is not None]
    stolen = held[7]
    assert backend.force_release(stolen.key)
    thief = backend.try_acquire(stolen.key, 3.0)
    assert thief is not None
    wait_for(lambda: all(i.ttl_left < 2.7 for i in backend.scan("job:*") if i.key != thief.key),
             timeout=5.0, message="TTLs did not run down")  # fmt: skip

    before = _script_calls(redis_cluster)
    results = backend.extend_many(held)
    extended = time.monotonic()
    after = _script_calls(redis_cluster)

    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1]
    assert results == [le is not stolen for le in held]
    assert stolen.lost and not any(le.lost for le in held if le is not stolen)
    for le in held:
        info = backend.inspect(le.key)
        assert info is not None
        if le is stolen:
            assert info.fence == thief.fence
        else:  # renewed to 3 s: above what any unrenewed one (under 2.7 s before) has left now
            assert info.ttl_left > 2.7 - (time.monotonic() - extended)


def test_slots_go_in_their_nodes_script_beside_the_locks(
    redis_cluster: LocalCluster, backend: RedisClusterBackend
) -> None:
    """Semaphore slots ride in the one script per node with the locks: a batch holding
    slots is still one script per node, each slot renewed or refused by its owner."""
    keys = _keys_on_every_node(redis_cluster, backend, 30)
    locks = [backend.try_acquire(k, 3.0) for k in keys[:15]]
    slots = [backend.semaphore_attempt(f"sem-{k}", 1, 3.0) for k in keys[15:]]
    held: list[Lease] = [le for le in [*locks, *slots] if isinstance(le, Lease)]
    assert len(held) == 30
    nodes = {redis_cluster.node_of(backend.keys.lock(le.key)) for le in held}
    assert nodes == {0, 1, 2}
    gone = slots[3]
    assert isinstance(gone, SlotLease)
    assert backend.semaphore_leave(gone.key, gone.owner)  # released behind the batch's back

    before = _script_calls(redis_cluster)
    results = backend.extend_many(held)
    after = _script_calls(redis_cluster)

    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1]
    assert results == [le is not gone for le in held]
    assert gone.lost and not any(le.lost for le in held if le is not gone)


def test_a_big_batch_is_several_scripts_per_node_in_one_write_even_after_a_script_flush(
    redis_cluster: LocalCluster, backend: RedisClusterBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_heartbeat, "EXTEND_CHUNK", 4)  # 30 leases: 3 scripts a node
    keys = _keys_on_every_node(redis_cluster, backend, 30)
    held = [le for le in (backend.try_acquire(k, 30.0) for k in keys) if le is not None]
    assert len(held) == len(keys)
    backend.extend_many(held)  # the script is on every node
    redis_cluster.masters[1].client().script_flush()  # a node that lost it answers NOSCRIPT
    per_node = [0, 0, 0]
    for le in held:
        per_node[redis_cluster.node_of(backend.keys.lock(le.key))] += 1
    before = _script_calls(redis_cluster)
    assert backend.extend_many(held) == [True] * len(held)
    sent = [b - a for a, b in zip(before, _script_calls(redis_cluster), strict=True)]
    chunks = [-(-n // 4) for n in per_node]
    assert sent == [chunks[0], 2 * chunks[1], chunks[2]], (sent, per_node)  # node 1: twice
    assert not any(le.lost for le in held)


def test_scan_lists_the_locks_of_every_node(
    redis_cluster: LocalCluster, backend: RedisClusterBackend
) -> None:
    keys = _keys_on_every_node(redis_cluster, backend, 24)
    leases = {k: backend.try_acquire(k, 10.0) for k in keys}
    other = RedisClusterBackend.from_url(redis_cluster.url, prefix=backend.keys.prefix + "x")
    try:
        assert other.try_acquire("job:0", 10.0) is not None  # another prefix: not listed
        found = {info.key: info.fence for info in backend.scan("job:*")}
    finally:
        other.close()
    assert found == {k: le.fence for k, le in leases.items() if le is not None}
    assert len(found) == len(keys)


def test_no_script_or_admin_call_meets_crossslot_over_many_slots(
    backend: RedisClusterBackend,
) -> None:
    keys = [f"order:{i}" for i in range(300)]
    assert len({key_slot(backend.keys.lock(k).encode()) for k in keys}) > 250
    for key in keys:
        lease = backend.begin(key, 5.0, record=True, fingerprint="fp")
        assert isinstance(lease, Lease)
        assert backend.claim_publish(key, "t1", 5.0) is None
        assert backend.claim_publish(key, "t2", 5.0) == "t1"
        backend.clear_publish(key)
        assert backend.count_delivery(key, 5.0) == 1
        assert backend.inspect(key) is not None
        assert backend.commit(lease, state="DONE", result="1", fingerprint="fp", result_ttl=5.0)
        record = backend.job_record(key)
        assert record is not None and record.state == "DONE"
        assert backend.forget(key)
        again = backend.try_acquire(key, 5.0)
        assert again is not None
        assert release_grant(backend, key, again.fence)
        backend.wait_for_release(key, 0.001)


def test_fence_guard_on_the_cluster(backend: RedisClusterBackend) -> None:
    guard = RedisFenceGuard(backend.cluster, prefix=backend.keys.prefix)
    resource = f"acct:{uuid.uuid4().hex[:6]}"
    first = backend.try_acquire(resource, 5.0)
    assert first is not None
    assert first.release()
    second = backend.try_acquire(resource, 5.0)
    assert second is not None
    balance = f"balance:{{{resource}}}"

    assert guard.write(resource, second.fence, [("INCRBY", balance, 10)]) == [10]
    with pytest.raises(StaleFence):
        guard.write(resource, first.fence, [("INCRBY", balance, 10)])
    # A key in another slot is refused before anything is sent, never a CROSSSLOT error.
    stray = "balance:elsewhere"
    assert key_slot(stray.encode()) != key_slot(balance.encode())
    with pytest.raises(FencedWriteRefused, match="hash slot"):
        guard.write(resource, second.fence, [("INCRBY", balance, 1), ("SET", stray, 1)],
                    write_id="w2")  # fmt: skip
    assert backend.cluster.get(balance) == "10"
    assert guard.last(resource) == second.fence


def test_capabilities_say_no_ha_without_replicas(backend: RedisClusterBackend) -> None:
    assert backend.capabilities.native_fencing and backend.capabilities.durable_fence
    assert not backend.capabilities.ha
    found = backend.check_servers()
    assert [refuse for refuse, _, _ in found] == [False]
    assert "no replicas" in found[0][1]


def test_start_up_refuses_a_node_that_may_evict(
    redis_cluster: LocalCluster, backend: RedisClusterBackend
) -> None:
    node: Any = redis_cluster.client(1)
    node.config_set("maxmemory-policy", "allkeys-lru")
    try:
        refusals = [problem for refuse, problem, _ in backend.check_servers() if refuse]
    finally:
        node.config_set("maxmemory-policy", "noeviction")
    assert len(refusals) == 1
    assert f":{redis_cluster.servers[1].port}" in refusals[0]
    assert "allkeys-lru" in refusals[0]


def test_lock_url_alone_opens_the_cluster(redis_cluster: LocalCluster) -> None:
    backend = open_backend(redis_cluster.url, prefix=f"rc-{uuid.uuid4().hex[:8]}")
    try:
        assert isinstance(backend, RedisClusterBackend)
        assert backend.try_acquire("k", 1.0) is not None
    finally:
        backend.close()


def test_cluster_url_parsing() -> None:
    nodes, user, password = cluster_nodes("redis+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2")
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", 6379)]
    assert (user, password) == ("u", "p@ss")
    assert cluster_nodes("redis+cluster://h:1/0")[0] == [("h", 1)]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+cluster://h:1/3", "database 0 only"),
        ("redis+cluster://h:1,,h:2", "names no host"),
        ("redis+cluster://h:x", "not a number"),
        ("redis+cluster://h:1?ssl=true", "does not take"),
    ],
)
def test_bad_cluster_urls_are_refused_naming_the_variable(url: str, problem: str) -> None:
    with pytest.raises(UnsafeSettings) as refused:
        cluster_nodes(url)
    text = str(refused.value)
    assert "JOBFENCE_LOCK_URL" in text and problem in text
    assert "redis+cluster://10.0.0.1:6379" in text


def test_settings_refuse_a_bad_cluster_url_and_keep_the_password_out() -> None:
    from jobfence.config import Settings

    with pytest.raises(UnsafeSettings) as refused:
        Settings(key_secret=SECRET, lock_url="redis+cluster://u:hunter2@h:1,h:99999")
    assert "JOBFENCE_LOCK_URL" in str(refused.value) and "hunter2" not in str(refused.value)
    assert Settings(key_secret=SECRET, lock_url="redis+cluster://h:1,h:2").lock_url == "redis+cluster://h:1,h:2"


def test_the_worker_start_up_checks_every_node(
    redis_cluster: LocalCluster, backend: RedisClusterBackend
) -> None:
    from types import SimpleNamespace

    from jobfence.config import Settings
    from jobfence.tasks import Runtime
    from jobfence.worker.checks import check_lock_backend

    runtime = Runtime(Settings(key_secret=SECRET, lock_url=redis_cluster.url), backend=backend)
    node: Any = redis_cluster.client(2)
    node.config_set("maxmemory-policy", "volatile-lru")
    try:
        findings = list(check_lock_backend(SimpleNamespace(task_always_eager=False), runtime))
    finally:
        node.config_set("maxmemory-policy", "noeviction")
    refused = [f for f in findings if f.refuse]
    assert len(refused) == 1 and "volatile-lru" in refused[0].problem
    assert refused[0].setting == "JOBFENCE_LOCK_URL"


def test_a_held_lease_follows_its_slot_through_a_migration(
    redis_cluster: LocalCluster, backend: RedisClusterBackend
) -> None:
    """Resharding under a held lease: while its slot migrates (ASK) and after it moved
    (MOVED), the lease extends and releases through a client whose map is stale."""
    key = f"moving:{uuid.uuid4().hex[:6]}"
    lease = backend.try_acquire(key, 5.0)
    assert lease is not None
    name = backend.keys.lock(key)
    slot = key_slot(name.encode())
    src = redis_cluster.node_of(name)
    dst = (src + 1) % 3
    source: Any = redis_cluster.client(src)
    target: Any = redis_cluster.client(dst)
    src_id, dst_id = redis_cluster.ids[src], redis_cluster.ids[dst]
    target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    keys = source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
    assert name in keys
    to = redis_cluster.servers[dst]
    source.execute_command("MIGRATE", to.host, to.port, "", 0, 5000, "KEYS", *keys)

    # Mid-migration: the source answers ASK for the keys it no longer has.
    assert backend.extend_many([lease]) == [True] and not lease.lost
    lease.extend()

    for index in range(3):
        c: Any = redis_cluster.client(index)
        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    wait_for(lambda: redis_cluster.node_of(name) == dst, timeout=10.0, message="slot not moved")

    # Moved: the backend's map still names the source, which answers MOVED.
    assert backend.extend_many([lease]) == [True] and not lease.lost
    info = backend.inspect(key)
    assert info is not None and info.fence == lease.fence
    assert lease.release()
    again = backend.try_acquire(key, 5.0)
    assert again is not None and again.fence > lease.fence
