"""Redis Cluster under a master's death: its slots fail over to a replica while leases are held.

jobfence's fence for a key is `max(last + 1, node µs)` in the key's slot, so the grant on the
promoted replica is above the dead master's, whatever the replica had received; the fence
guard then refuses the old holder's late write. The control, a SET NX lock without a fence
on the same slot, lets the old holder's late write land over the new holder's.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.local_cluster import LocalCluster
from jobfence.locks import BackendUnavailable, Lease, LeaseKeeper, RedisFenceGuard, StaleFence
from jobfence.locks.backends.redis.cluster import RedisClusterBackend
from jobfence.locks.slots import SlotLease
from tests.faults.rig import CHARGE, Rig, plan_payments, wait_until
from tests.faults.scenarios_cdefh import SETTLE_TIMEOUT
from tests.servers import wait_for

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """3 masters + 3 replicas, failing over 1 s after a master stops answering."""
    with LocalCluster(masters=3, replicas=1, node_timeout_ms=1000) as c:
        yield c


def _key_on(cluster: LocalCluster, backend: RedisClusterBackend, node: int, tag: str) -> str:
    for i in itertools.count():
        key = f"{tag}:{i}"
        if cluster.node_of(backend.keys.lock(key)) == node:
            return key
    raise AssertionError("unreachable")


def _acquire(backend: RedisClusterBackend, key: str, ttl: float) -> Lease | None:
    try:
        return backend.try_acquire(key, ttl)
    except BackendUnavailable:  # the slot's master is dead and no replica took over yet
        return None


def test_extend_many_renews_the_live_nodes_while_one_is_dead(cluster: LocalCluster) -> None:
    cluster.wait_ok()
    backend = RedisClusterBackend.from_url(cluster.url, prefix=f"cf-{uuid.uuid4().hex[:6]}")
    # A TTL far above a failover's time on a loaded machine: the stuck lease must still be
    # held on the promoted replica when it answers (a slower failover is not under test).
    ttl = 60.0
    leases = {node: backend.try_acquire(_key_on(cluster, backend, node, "hb"), ttl)
              for node in (0, 1, 2)}  # fmt: skip
    assert all(leases.values())
    held = [le for le in leases.values() if le is not None]
    wait_for(lambda: all(le.remaining() < ttl - 0.2 for le in held), timeout=5.0,
             message="leases did not run down")  # fmt: skip
    before = {le.key: le.deadline for le in held}
    # The lock is on node 1's replica before node 1 dies (replication is asynchronous:
    # a write the replica never got is lost with its master, which is not under test).
    with cluster.client(1) as master:
        assert master.execute_command("WAIT", 1, 10_000) >= 1

    cluster.servers[1].kill()  # its replica takes over its slots a little later
    with pytest.raises(BackendUnavailable):
        backend.extend_many(held)

    for node in (0, 2):
        lease = leases[node]
        assert lease is not None and not lease.lost
        assert lease.deadline > before[lease.key]  # renewed although a node was dead
    stuck = leases[1]
    assert stuck is not None and not stuck.lost  # unknown is not lost
    assert stuck.deadline == before[stuck.key]
    # Once the replica serves the slot, the same lease extends again: the lock replicated.
    killed = time.monotonic()
    wait_for(lambda: stuck.lost or _extends(backend, held), timeout=45.0,
             message="no extension after failover")  # fmt: skip
    assert not stuck.lost, (
        f"the promoted replica refused the lease {time.monotonic() - killed:.1f}s after the kill"
    )
    backend.close()


def _extends(backend: RedisClusterBackend, leases: list[Lease]) -> bool:
    try:
        return all(backend.extend_many(leases))
    except BackendUnavailable:
        return False


def test_fence_keeps_increasing_across_a_failover_and_the_late_write_is_refused(
    cluster: LocalCluster,
) -> None:
    cluster.wait_ok()
    backend = RedisClusterBackend.from_url(cluster.url, prefix=f"cf-{uuid.uuid4().hex[:6]}")
    assert backend.capabilities.ha
    guard = RedisFenceGuard(backend.cluster, prefix=backend.keys.prefix)
    key = _key_on(cluster, backend, 0, "pay")
    balance, naive_lock, naive_balance = (f"{n}:{{{key}}}" for n in ("bal", "naive", "nbal"))
    data: Any = backend.cluster

    fences = []
    for _ in range(20):
        lease = backend.try_acquire(key, 5.0)
        assert lease is not None
        fences.append(lease.fence)
        assert lease.release()
    old = backend.try_acquire(key, 1.0)  # the holder that will outlive its lease
    assert old is not None
    fences.append(old.fence)
    assert guard.write(key, old.fence, [("SET", balance, "old-1")]) == ["OK"]
    # The control holds a fence-less lock on the same slot, written the usual way.
    assert data.set(naive_lock, "old", nx=True, px=1000)
    data.set(naive_balance, "old-1")

    cluster.servers[0].kill()  # the master of the key's slot; its replica takes over

    new = wait_for(lambda: _acquire(backend, key, 10.0), timeout=30.0,
                   message="no grant after the failover")  # fmt: skip
    # Served by the promoted replica (the other nodes learn of it a moment later).
    wait_for(lambda: cluster.node_of(backend.keys.lock(key)) == 3, timeout=10.0,
             message="the slot's replica was not promoted")  # fmt: skip
    fences.append(new.fence)
    for _ in range(20):
        assert new.release()
        new = backend.try_acquire(key, 10.0)  # type: ignore[assignment]
        assert new is not None
        fences.append(new.fence)
    assert all(a < b for a, b in itertools.pairwise(fences))

    assert guard.write(key, new.fence, [("SET", balance, "new")]) == ["OK"]
    with pytest.raises(StaleFence):
        guard.write(key, old.fence, [("SET", balance, "old-late")], write_id="late")
    assert data.get(balance) == "new"

    # The control: the new holder takes the expired fence-less lock and writes; the old
    # holder, back from its pause, writes too, and its stale value wins.
    wait_for(lambda: data.set(naive_lock, "new", nx=True, px=10_000), timeout=5.0,
             message="the control lock never came free")  # fmt: skip
    data.set(naive_balance, "new")
    data.set(naive_balance, "old-late")
    assert data.get(naive_balance) == "old-late"
    backend.close()


@pytest.mark.integration
@pytest.mark.slow
def test_a_payment_storm_on_real_workers_charges_once_across_a_master_kill(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A payment storm on a real fleet locked on the cluster; a master is killed when a third
    is charged, and every other payment is published again after it: every payment is
    charged once, none is lost. (The fence-less control is the test above: a second holder
    during the failover writes over the first.)"""
    cluster.wait_ok()
    n = 24
    planned = plan_payments("cl", n)
    with Rig("jobfence", tmp_path, start_locks=False,
             env_extra={"JOBFENCE_LOCK_URL": cluster.url}) as rig:  # fmt: skip
        fleet = rig.fleet(workers=2, concurrency=2)
        rig.publish(CHARGE, planned)
        wait_until(lambda: rig.done(planned) >= n // 3 and fleet.executing_pids(), 60.0,
                   "a third of the payments charged, bodies running")  # fmt: skip
        at = rig.done(planned)
        cluster.servers[2].kill()  # a master with its replica: its slots fail over
        rig.publish(CHARGE, planned[::2])
        rig.settle(fleet, planned, SETTLE_TIMEOUT)
        outcome = rig.tally(planned, f"master killed at {at}/{n} charged")
    assert (outcome.double, outcome.lost) == (0, 0), outcome
    assert not outcome.broken, outcome


PAUSE_TTL = 2.0


def test_a_paused_master_delays_no_other_masters_locks_or_slots() -> None:
    """A keeper batch holds locks and semaphore slots on every master; one master is
    SIGSTOPped for three TTLs: the locks and slots on the others stay renewed."""
    # No replicas and a long node timeout: the cluster stays "ok" (no failover, no
    # CLUSTERDOWN on the healthy masters) while the one master is paused.
    with LocalCluster(masters=3, node_timeout_ms=120_000) as cluster:
        backend = RedisClusterBackend.from_url(
            cluster.url, prefix=f"cp-{uuid.uuid4().hex[:6]}", socket_timeout=0.5
        )
        keeper = LeaseKeeper(clock=backend.clock)
        try:
            locks = [backend.try_acquire(_key_on(cluster, backend, n, "lk"), PAUSE_TTL)
                     for n in (0, 1, 2)]  # fmt: skip
            slots = [backend.semaphore_attempt(_key_on(cluster, backend, n, "sm"), 1, PAUSE_TTL)
                     for n in (0, 1, 2)]  # fmt: skip
            held: list[Lease] = []
            for lease in [*locks, *slots]:
                assert isinstance(lease, Lease)
                held.append(lease)
                keeper.keep(lease)
            healthy = [locks[0], locks[2], slots[0], slots[2]]
            with cluster.servers[1].suspended():
                paused_at = time.monotonic()
                while time.monotonic() < paused_at + 3 * PAUSE_TTL:
                    time.sleep(0.1)
                    lost = [le.key for le in healthy if le is not None and not le.held]
                    assert not lost, f"leases on healthy masters lost while one paused: {lost}"
            for lease in healthy:  # the server agrees: still theirs
                assert isinstance(lease, Lease)
                if isinstance(lease, SlotLease):
                    assert [s.fence for s in backend.semaphore_holders(lease.key)] == [lease.fence]
                else:
                    info = backend.inspect(lease.key)
                    assert info is not None and info.fence == lease.fence
        finally:
            keeper.stop()
            backend.close()
