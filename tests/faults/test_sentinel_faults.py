"""Sentinel failover onto a replica that never received the lock: fences keep the data safe.

The fault (research notes §6): the lock is written on a master whose replicas are frozen and
cut off, the master is killed, and a replica is promoted without the lock. A second holder
then gets the same key while the first still believes it holds it; Sentinel cannot prevent
that. jobfence's fence on the new master is still higher (server microseconds), so the
resource's fence guard refuses the first holder's late write. The control, redis-py's own
Lock through the same Sentinel, shows the two holders and both writes applied.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

from devstack.local_sentinel import HOST, LocalSentinel
from jobfence.locks import Lease, LeaseLost, RedisFenceGuard, StaleFence
from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend
from tests.servers import RedisServer, wait_for

pytestmark = pytest.mark.fault

PREFIX = "stf"


@pytest.fixture
def topology() -> Iterator[LocalSentinel]:
    """A topology of this test's own: its master is killed."""
    with LocalSentinel() as t:
        yield t


def sentinel_backend(topology: LocalSentinel) -> RedisSentinelBackend:
    return RedisSentinelBackend.from_url(topology.url, prefix=PREFIX, socket_timeout=1.0)


def acquire_on_new_master(backend: RedisSentinelBackend, key: str) -> Lease:
    def attempt() -> Lease | None:
        try:
            return backend.try_acquire(key, 30.0)
        except Exception:  # the first calls may meet the dead master's connections
            return None

    return wait_for(attempt, timeout=15.0, message="no grant on the promoted replica")


def test_a_lock_lost_in_a_failover_gets_a_higher_fence_and_the_old_write_is_refused(
    topology: LocalSentinel, fresh_redis: RedisServer
) -> None:
    first, second = sentinel_backend(topology), sentinel_backend(topology)
    guard = RedisFenceGuard(fresh_redis.client(decode_responses=True), prefix="res")
    store = fresh_redis.client(decode_responses=True)
    try:
        old = topology.failover_losing(lambda: first.try_acquire("account:1", 30.0))
        assert old is not None  # granted for 30 s on a master that is gone

        new = acquire_on_new_master(second, "account:1")  # the lock key was lost
        assert new.fence > old.fence

        guard.write("account:1", new.fence, [("RPUSH", "writes", "new")], write_id="w")
        with pytest.raises(StaleFence):
            guard.write("account:1", old.fence, [("RPUSH", "writes", "old")], write_id="w")
        assert store.lrange("writes", 0, -1) == ["new"]

        # The first holder learns it lost the lease as soon as its backend sees the new
        # master (which does not hold it), and its owner-checked release leaves the new
        # holder's lock alone.
        wait_for(lambda: old.lost, timeout=10.0,
                 message="the old holder was never told of the new master")  # fmt: skip
        assert _extended(first, old) is False
        with pytest.raises(LeaseLost):
            old.check()
        assert old.release() is False
        info = second.inspect("account:1")
        assert info is not None and info.fence == new.fence
        assert new.release()
    finally:
        first.close()
        second.close()


def _extended(backend: RedisSentinelBackend, lease: Lease) -> bool | None:
    """extend_many's answer for `lease`, None while the lock server cannot be reached."""
    try:
        return backend.extend_many([lease])[0]
    except Exception:
        return None


def test_control_redis_py_lock_through_sentinel_gives_two_holders_and_two_writes(
    topology: LocalSentinel, fresh_redis: RedisServer
) -> None:
    sentinel = Sentinel([(HOST, s.port) for s in topology.sentinels], socket_timeout=1.0,
                        sentinel_kwargs={"socket_timeout": 1.0})  # fmt: skip
    master = sentinel.master_for(topology.service, socket_timeout=1.0,
                                 retry=Retry(NoBackoff(), 0))  # fmt: skip
    store = fresh_redis.client(decode_responses=True)
    try:
        old = master.lock("account:1", timeout=30)
        assert topology.failover_losing(lambda: old.acquire(blocking=False))

        def acquire_new() -> redis.lock.Lock | None:
            new = master.lock("account:1", timeout=30)
            try:
                return new if new.acquire(blocking=False) else None
            except redis.RedisError:
                return None

        new = wait_for(acquire_new, timeout=15.0, message="no grant on the promoted replica")
        assert old.owned() is False  # ... but its holder is never told: it has no keeper
        # Two holders at once; with no fence, both writes land, the stale one last.
        store.rpush("writes", "new")
        store.rpush("writes", "old")
        assert store.lrange("writes", 0, -1) == ["new", "old"]
        new.release()
    finally:
        master.close()
        sentinel.close()
