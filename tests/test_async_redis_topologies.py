"""AsyncLocker's native stores on Sentinel, Cluster and Redlock, on real servers: a loop and two
processes contend with no overlap, a holder outlives three TTLs, cancellation leaves nothing
behind, a paused server stalls neither the loop nor the others' leases."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from jobfence import AsyncLocker
from jobfence.locks import open_backend
from jobfence.locks.aio import ThreadStore
from jobfence.locks.backends.redis.cluster_async import AsyncClusterStore
from jobfence.locks.backends.redis.semaphores import semaphore_keys
from jobfence.locks.backends.redis.sentinel_async import AsyncSentinelStore
from jobfence.locks.backends.redlock.store_async import AsyncRedlockStore
from jobfence.locks.ops import Extend
from jobfence.locks.slots import SlotLease
from tests.contend import assert_exclusive_and_fenced, contend

COROUTINES = 50
PROCESSES = 2
PER_PROCESS = 10


@pytest.fixture(scope="module")
def sentinel_url() -> Iterator[str]:
    """A private Sentinel topology (1 master, 2 replicas, 3 sentinels) for this module."""
    from devstack.local_sentinel import LocalSentinel

    # No failover is wanted here: 5 s before a master is judged down (1 s once failed it
    # over spuriously under CI load, and a call in flight was refused for the new master).
    topology = LocalSentinel(down_after_ms=5000).start()
    try:
        topology.wait_ready()
        yield topology.url
    finally:
        topology.stop()


@pytest.fixture(scope="module")
def redlock_url() -> Iterator[str]:
    """Five private Redlock masters for this module."""
    from devstack.redis_masters import RedisMasters

    masters = RedisMasters(5).start()
    try:
        yield masters.url
    finally:
        masters.stop()


@pytest.fixture(params=["sentinel", "cluster", "redlock"])
def topology(request: pytest.FixtureRequest) -> tuple[str, str, type]:
    """(lock URL, key prefix of this test's own, the native store expected for it)."""
    if request.param == "sentinel":
        url, kind = request.getfixturevalue("sentinel_url"), AsyncSentinelStore
    elif request.param == "redlock":
        url, kind = request.getfixturevalue("redlock_url"), AsyncRedlockStore
    else:
        url, kind = request.getfixturevalue("redis_cluster").url, AsyncClusterStore
    return url, f"aio-{uuid.uuid4().hex[:8]}", kind


def _locker(url: str, prefix: str, **options: Any) -> AsyncLocker:
    return AsyncLocker.from_url(url, prefix=prefix, **options)


def test_loop_and_processes_exclude_each_other(topology: tuple[str, str, type]) -> None:
    url, prefix, kind = topology

    def native() -> AsyncLocker:
        locker = _locker(url, prefix, ttl=10, timeout=120)
        assert isinstance(locker.store, kind)  # native, not the thread offload
        return locker

    _contend_without_overlap(url, prefix, native)


def test_thread_offload_on_sentinel_reloads_scripts_without_breaking_connections(
    sentinel_url: str,
) -> None:
    """The sync Sentinel backend behind the thread offload, on a master that lost its scripts:
    every thread's first call meets NOSCRIPT at once, and no reload breaks another thread's
    connection (it once disconnected the whole pool: "Bad file descriptor")."""
    prefix = f"aio-{uuid.uuid4().hex[:8]}"
    admin: Any = open_backend(sentinel_url)
    admin.client.script_flush()
    admin.close()

    def offloaded() -> AsyncLocker:
        backend = open_backend(sentinel_url, prefix=prefix)
        return AsyncLocker(ThreadStore(backend), clock=backend.clock, ttl=10, timeout=120)

    _contend_without_overlap(sentinel_url, prefix, offloaded)


def _contend_without_overlap(url: str, prefix: str, make: Callable[[], AsyncLocker]) -> None:
    """COROUTINES holders on `make()`'s locker and PROCESSES sync ones contend for one key:
    no two hold it at once and the fences rise in grant order."""
    held = contend(url, make, key="one", coroutines=COROUTINES, processes=PROCESSES,
                   per_process=PER_PROCESS, prefix=prefix)  # fmt: skip
    assert_exclusive_and_fenced(held, COROUTINES + PROCESSES * PER_PROCESS)


def test_holders_awaiting_three_ttls_keep_their_leases(topology: tuple[str, str, type]) -> None:
    """Locks and slots (where the store keeps them) on many keys (on a cluster: on all three
    masters) outlive 3 TTLs."""
    url, prefix, _ = topology
    backend = open_backend(url, prefix=prefix)
    keys = [f"long-{i}" for i in range(12)]
    if "cluster" in url:
        nodes = backend.cluster.nodes_manager  # type: ignore[attr-defined]
        served = {nodes.get_node_from_slot(backend.cluster.keyslot(  # type: ignore[attr-defined]
            backend.keys.lock(k))).name for k in keys}  # fmt: skip
        assert len(served) == 3, "the keys should spread over the three masters"

    async def main() -> None:
        locker = _locker(url, prefix)
        async with _held_together(locker, keys, slots="redlock" not in url) as leases:
            await asyncio.sleep(3.7)  # more than three TTLs
            for lease in leases:
                lease.check()
            for lease in leases[: len(keys)]:
                info = backend.inspect(lease.key)
                assert info is not None and info.fence == lease.fence
        for key in keys:
            assert backend.inspect(key) is None
        await locker.aclose()

    asyncio.run(main())
    backend.close()


@contextlib.asynccontextmanager
async def _held_together(
    locker: AsyncLocker, keys: list[str], *, slots: bool = True
) -> AsyncIterator[list[Any]]:
    """Every key's lock, then (with `slots`) a slot of a semaphore per key, held together
    (ttl 1.2 s: 0.6 s lapsed once, 24 leases on three masters on a loaded CI machine)."""
    async with contextlib.AsyncExitStack() as stack:
        leases = [await stack.enter_async_context(locker.lock(k, ttl=1.2, timeout=5))
                  for k in keys]  # fmt: skip
        for k in keys if slots else ():
            slot = locker.semaphore(f"sem-{k}", limit=1, ttl=1.2, timeout=5)
            leases.append(await stack.enter_async_context(slot))
        yield leases


async def _until(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_cancellation_leaves_nothing_behind(topology: tuple[str, str, type]) -> None:
    url, prefix, _ = topology
    if "redlock" in url:
        pytest.skip("redlock keeps no semaphores: tests/test_async_redlock.py cancels its grants")
    backend: Any = open_backend(url, prefix=prefix)
    client = backend.cluster if "cluster" in url else backend.client

    async def main() -> None:
        locker = _locker(url, prefix)
        holder = await locker.acquire("w", ttl=30)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await locker.acquire("w", ttl=30, timeout=60)
        took, leave = asyncio.Event(), asyncio.Event()

        async def take_slot() -> None:
            # A wait far longer than the test: only the cancel may end it, never its timeout.
            async with locker.semaphore("sem", limit=1, ttl=30, timeout=30):
                took.set()
                await leave.wait()

        first = asyncio.ensure_future(take_slot())
        await took.wait()
        waiter = asyncio.ensure_future(take_slot())
        queue = semaphore_keys(prefix, "sem")[1]
        await _until(lambda: client.zcard(queue) == 1, 10)  # it waits in the queue
        waiter.cancel()
        await asyncio.wait([waiter], timeout=5)
        assert waiter.cancelled(), "the cancel was not delivered"
        assert client.zcard(queue) == 0
        assert len(locker.keeper.held()) == 2  # the lock and the first slot, no more
        # A holder cancelled while holding releases at once.
        entered = asyncio.Event()

        async def hold() -> None:
            async with locker.lock("h", ttl=30):
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.ensure_future(hold())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.inspect("h") is None
        leave.set()
        await first
        await locker.release(holder)
        assert not locker.keeper.held()
        # The keeper task ends with its last lease (polled: it ends on its next step).
        await _until(lambda: [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                     == [], 5)  # fmt: skip
        async with locker.lock("w", ttl=30, blocking=False):
            pass  # free at once: no grant left behind
        await locker.aclose()

    asyncio.run(main())
    backend.close()


PAUSE_TTL = 2.0


def test_a_paused_cluster_master_delays_no_other_masters_leases() -> None:
    """The async keeper holds a lock and a semaphore slot on every master; one master is
    SIGSTOPped for three TTLs: the leases on the others stay renewed, the server agrees."""
    from devstack.local_cluster import LocalCluster

    # No replicas and a long node timeout: the cluster stays "ok" while one master is paused.
    with LocalCluster(masters=3, node_timeout_ms=120_000) as cluster:
        prefix = f"aio-cp-{uuid.uuid4().hex[:6]}"
        backend: Any = open_backend(cluster.url, prefix=prefix)

        def key_on(node: int, tag: str, lock: bool) -> str:
            for i in itertools.count():
                key = f"{tag}:{i}"
                name = backend.keys.lock(key) if lock else semaphore_keys(prefix, key)[0]
                if cluster.node_of(name) == node:
                    return key
            raise AssertionError("unreachable")

        async def main() -> None:
            locker = AsyncLocker.from_url(cluster.url, prefix=prefix, socket_timeout=0.5)
            assert isinstance(locker.store, AsyncClusterStore)
            locks = [await locker.acquire(key_on(n, "lk", True), ttl=PAUSE_TTL) for n in (0, 1, 2)]
            slots = []
            for n in (0, 1, 2):
                stack = contextlib.AsyncExitStack()
                slot = locker.semaphore(key_on(n, "sm", False), limit=1, ttl=PAUSE_TTL)
                slots.append((stack, await stack.enter_async_context(slot)))
            healthy = [locks[0], locks[2], slots[0][1], slots[2][1]]
            with cluster.servers[1].suspended():
                paused_at = time.monotonic()
                while time.monotonic() < paused_at + 3 * PAUSE_TTL:
                    await asyncio.sleep(0.1)
                    lost = [le.key for le in healthy if not le.held]
                    assert not lost, f"leases on healthy masters lost while one paused: {lost}"
            for lease in healthy:  # the server agrees: still theirs
                if type(lease) is SlotLease:
                    assert [s.fence for s in backend.semaphore_holders(lease.key)] == [lease.fence]
                else:
                    info = backend.inspect(lease.key)
                    assert info is not None and info.fence == lease.fence
            for lease in locks:
                with contextlib.suppress(Exception):  # the paused one's may be lost by now
                    await locker.release(lease)
            for stack, _ in slots:
                with contextlib.suppress(Exception):
                    await stack.aclose()
            await locker.aclose()

        try:
            asyncio.run(main())
        finally:
            backend.close()


def test_a_fresh_cluster_store_extends_a_sync_grant_as_its_first_call(
    redis_cluster: Any,
) -> None:
    """An asyncio store whose very first operation is an extension (a lease granted by a
    sync holder) reads the slot map first: the lease is renewed, never a KeyError from an
    empty map."""
    prefix = f"aio-{uuid.uuid4().hex[:8]}"
    backend = open_backend(redis_cluster.url, prefix=prefix)
    lease = backend.try_acquire("first-call", 5.0)
    assert lease is not None

    async def extend_first() -> list[bool]:
        store = AsyncClusterStore.from_url(redis_cluster.url, prefix=prefix)
        try:
            return list(await store.execute_async(Extend([lease])))
        finally:
            await store.aclose()

    assert asyncio.run(extend_first()) == [True]
    assert backend.release(lease)
    backend.close()
