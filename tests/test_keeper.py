"""LeaseKeeper: kept leases outlive their TTL, frozen server = lost lease, drops honoured."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from jobfence.locks import (
    BackendUnavailable,
    Lease,
    LeaseKeeper,
    LeaseLost,
    ManualClock,
    MemoryBackend,
    NotOwner,
    RedisBackend,
)
from tests.servers import RedisServer, wait_for


def _key(name: str) -> str:
    return f"{name}:{uuid.uuid4().hex[:8]}"


def _take(backend: Any, key: str, ttl: float) -> Lease:
    lease = backend.try_acquire(key, ttl)
    assert lease is not None, f"{key} is held"
    return lease


class LossLog:
    """Collects on_lost callbacks: which lease, why, when (monotonic), and its deadline then."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.calls: list[tuple[Lease, BaseException, float, float]] = []

    def __call__(self, lease: Lease, cause: BaseException) -> None:
        self.calls.append((lease, cause, time.monotonic(), lease.deadline))
        self.event.set()


class ExtendLog:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def __call__(self, backend_name: str, seconds: float, n: int) -> None:
        self.calls.append((backend_name, seconds, n))


@pytest.fixture
def keeper_factory() -> Iterator[Any]:
    keepers: list[LeaseKeeper] = []

    def make(**kwargs: Any) -> LeaseKeeper:
        k = LeaseKeeper(**kwargs)
        keepers.append(k)
        return k

    yield make
    for k in keepers:
        k.stop()


def _manual(keeper: LeaseKeeper, leases: Sequence[Lease]) -> None:
    """Hand `leases` to the keeper, then stop its thread so the test drives tick() itself.

    With the ManualClock standing still nothing is due yet, so a tick the thread may run
    before it stops changes nothing.
    """
    for lease in leases:
        keeper.keep(lease)
    keeper.stop()


# --------------------------------------------------------------------------- unit: ManualClock


def test_fraction_must_be_below_half() -> None:
    for bad in (0, 0.5, 0.9, -0.1):
        with pytest.raises(ValueError, match="fraction"):
            LeaseKeeper(fraction=bad)


def test_tick_extends_due_leases_one_batch_per_backend(keeper_factory: Any) -> None:
    clock = ManualClock()
    b1, b2 = MemoryBackend(clock=clock), MemoryBackend(clock=clock)
    leases = [_take(b1, "a", 3.0), _take(b1, "b", 3.0), _take(b2, "c", 3.0)]
    extends = ExtendLog()
    keeper = keeper_factory(clock=clock, on_extend=extends)
    _manual(keeper, leases)

    assert keeper.tick() == pytest.approx(1.0)  # nothing due yet: wake at ttl/3
    assert extends.calls == []
    clock.advance(1.0)
    keeper.tick()
    assert sorted(n for _, _, n in extends.calls) == [1, 2]  # one extend_many per backend
    for lease in leases:
        assert lease.deadline == pytest.approx(clock.now + 3.0)
        info = lease.backend.inspect(lease.key)
        assert info is not None and info.ttl_left == pytest.approx(3.0)

    # Kept for ten TTLs with the clock moving a third of a TTL at a time.
    for _ in range(30):
        clock.advance(1.0)
        keeper.tick()
    assert all(le.held for le in leases)
    assert len(extends.calls) == 2 + 2 * 30
    assert set(keeper.held()) == set(leases)


def test_lease_past_its_deadline_is_marked_lost(keeper_factory: Any) -> None:
    clock = ManualClock()
    backend = MemoryBackend(clock=clock)
    lease = _take(backend, "late", 3.0)
    losses = LossLog()
    keeper = keeper_factory(clock=clock, on_lost=losses)
    _manual(keeper, [lease])

    clock.advance(3.5)  # the keeper never got to run: the deadline passed
    keeper.tick()
    assert losses.event.is_set()
    (lost, cause, _, _) = losses.calls[0]
    assert lost is lease and isinstance(cause, LeaseLost)
    with pytest.raises(LeaseLost):
        lease.check()
    assert keeper.held() == []


def test_refused_extension_marks_lease_lost(keeper_factory: Any) -> None:
    clock = ManualClock()
    backend = MemoryBackend(clock=clock)
    lease = _take(backend, "stolen", 3.0)
    losses = LossLog()
    keeper = keeper_factory(clock=clock, on_lost=losses)
    _manual(keeper, [lease])

    assert backend.force_release("stolen")
    thief = _take(backend, "stolen", 3.0)
    clock.advance(1.0)
    keeper.tick()
    assert len(losses.calls) == 1 and isinstance(losses.calls[0][1], NotOwner)
    assert lease.lost and not thief.lost
    keeper.tick()
    assert keeper.held() == []
    info = backend.inspect("stolen")
    assert info is not None and info.fence == thief.fence


class BrokenBackend(MemoryBackend):
    """A memory backend whose server is unreachable for extensions."""

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        raise BackendUnavailable("unreachable (test)")


def test_failing_backend_loses_its_batch_only(keeper_factory: Any) -> None:
    clock = ManualClock()
    broken, healthy = BrokenBackend(clock=clock), MemoryBackend(clock=clock)
    doomed = [_take(broken, "x", 3.0), _take(broken, "y", 3.0)]
    kept = _take(healthy, "z", 3.0)
    losses = LossLog()
    keeper = keeper_factory(clock=clock, on_lost=losses)
    _manual(keeper, [*doomed, kept])

    for _ in range(9):
        clock.advance(1.0)
        keeper.tick()
    assert {id(c[0]) for c in losses.calls} == {id(le) for le in doomed}
    assert all(isinstance(c[1], LeaseLost) for c in losses.calls)
    assert all(le.lost for le in doomed)
    assert kept.held
    assert keeper.held() == [kept]


def test_released_and_dropped_leases_are_not_extended(keeper_factory: Any) -> None:
    clock = ManualClock()
    backend = MemoryBackend(clock=clock)
    released, dropped, kept = (_take(backend, k, 3.0) for k in ("r", "d", "k"))
    extends = ExtendLog()
    keeper = keeper_factory(clock=clock, on_extend=extends)
    _manual(keeper, [released, dropped, kept])

    assert released.release()
    keeper.drop(dropped)
    clock.advance(1.0)
    keeper.tick()
    assert extends.calls and all(n == 1 for _, _, n in extends.calls)
    assert keeper.held() == [kept]
    clock.advance(2.5)  # the dropped lease is not extended and expires on the server
    assert backend.inspect("d") is None
    assert backend.inspect("k") is not None


def test_lease_its_caller_dropped_is_not_kept(keeper_factory: Any) -> None:
    clock = ManualClock()
    backend = MemoryBackend(clock=clock)
    keeper = keeper_factory(clock=clock)
    lease = _take(backend, "orphan", 3.0)
    _manual(keeper, [lease])
    ref = weakref.ref(lease)
    del lease
    gc.collect()
    assert ref() is None
    assert keeper.held() == []
    clock.advance(3.5)
    keeper.tick()
    assert backend.inspect("orphan") is None


def _child_after_fork(keeper: LeaseKeeper, out: Any) -> None:
    try:
        inherited = len(keeper.held())
        backend = MemoryBackend()
        lease = _take(backend, "child", 0.5)
        keeper.keep(lease)
        time.sleep(1.5)  # three TTLs: only the child's own keeper thread can keep it
        out.put((inherited, lease.held))
        keeper.stop()
    except BaseException as exc:
        out.put(("error", repr(exc)))


def test_keeper_restarts_in_a_forked_child(keeper_factory: Any) -> None:
    backend = MemoryBackend()
    keeper = keeper_factory()
    parent_lease = _take(backend, "parent", 30.0)
    keeper.keep(parent_lease)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_after_fork, args=(keeper, out), daemon=True)
    child.start()
    try:
        result = out.get(timeout=20)
    finally:
        child.join(10)
        if child.is_alive():
            child.terminate()
            child.join(5)
    assert result == (0, True), result
    assert keeper.held() == [parent_lease]


# --------------------------------------------------------------------------- real Redis


def test_kept_lease_outlives_five_ttls(redis_url: str, keeper_factory: Any) -> None:
    backend = RedisBackend.from_url(redis_url, socket_timeout=0.3)
    rival = RedisBackend.from_url(redis_url, socket_timeout=0.3)
    losses, extends = LossLog(), ExtendLog()
    keeper = keeper_factory(on_lost=losses, on_extend=extends)
    key = _key("kept")
    lease = _take(backend, key, 0.5)
    keeper.keep(lease)

    end = time.monotonic() + 2.6  # more than five TTLs
    checks = 0
    while time.monotonic() < end:
        assert rival.try_acquire(key, 0.5) is None, "someone else acquired a kept lease"
        info = rival.inspect(key)
        assert info is not None and info.fence == lease.fence
        assert lease.held
        checks += 1
        time.sleep(0.05)  # the hold itself is what is under test
    assert checks > 10
    assert not losses.calls
    assert len(extends.calls) >= 5
    keeper.drop(lease)
    assert lease.release()
    backend.close()
    rival.close()


def test_frozen_server_means_lost_lease_before_its_deadline(
    fresh_redis: RedisServer, redis_url: str, keeper_factory: Any
) -> None:
    frozen = RedisBackend.from_url(fresh_redis.url, socket_timeout=0.3)
    healthy = RedisBackend.from_url(redis_url, socket_timeout=0.3)
    losses, extends = LossLog(), ExtendLog()
    keeper = keeper_factory(on_lost=losses, on_extend=extends)
    victim = _take(frozen, _key("victim"), 2.0)
    survivor = _take(healthy, _key("survivor"), 1.0)
    keeper.keep(victim)
    keeper.keep(survivor)
    wait_for(lambda: len(extends.calls) >= 2, timeout=5.0, message="no extension ran")

    fresh_redis.pause()
    try:
        paused_at = time.monotonic()
        assert losses.event.wait(5.0), "the keeper never noticed the frozen server"
        lost, cause, lost_at, deadline = losses.calls[0]
        assert lost is victim
        assert isinstance(cause, LeaseLost)
        assert lost_at < deadline, f"marked lost {lost_at - deadline:.3f}s after the deadline"
        assert lost_at - paused_at < 2.0
        with pytest.raises(LeaseLost):
            victim.check()

        # The keeper lives on and keeps the other backend's lease for three more TTLs.
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            assert survivor.held
            info = healthy.inspect(survivor.key)
            assert info is not None and info.fence == survivor.fence
            time.sleep(0.05)
        assert [c[0] for c in losses.calls] == [victim]
    finally:
        fresh_redis.resume()

    # ... and keeps new leases on the server once it is back.
    def retake() -> Lease | None:
        try:
            return frozen.try_acquire(_key("after"), 0.6)
        except BackendUnavailable:
            return None

    again = wait_for(retake, timeout=10.0, message="no grant after resume")
    keeper.keep(again)
    until = time.monotonic() + 1.5
    while time.monotonic() < until:
        assert again.held
        time.sleep(0.05)
    assert victim not in keeper.held()
    frozen.close()
    healthy.close()


def test_dropped_reference_is_not_kept_on_redis(redis_url: str, keeper_factory: Any) -> None:
    backend = RedisBackend.from_url(redis_url, socket_timeout=0.3)
    keeper = keeper_factory()
    key = _key("weak")
    lease = _take(backend, key, 0.5)
    keeper.keep(lease)
    ref = weakref.ref(lease)
    del lease

    def collected() -> bool:
        gc.collect()
        return ref() is None

    wait_for(collected, timeout=5.0, message="the keeper holds the lease strongly")
    assert keeper.held() == []
    wait_for(lambda: backend.inspect(key) is None, timeout=3.0, message="still extended")
    backend.close()
