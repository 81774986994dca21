"""LeaseKeeper: kept leases outlive their TTL, frozen server = lost lease, drops honoured."""

from __future__ import annotations

import collections
import gc
import multiprocessing
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
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
from jobfence.locks.backends.redis import EXTEND_CHUNK
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


def test_frozen_server_means_lost_lease_at_its_deadline(
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
        assert isinstance(cause, LeaseLost) and "deadline" in str(cause)
        # Timeouts are retried: lost at the deadline (less the drift margin), not at the
        # first timeout; the body's check() raises from that moment on whatever the thread.
        assert lost_at >= deadline - victim.drift - 0.05, "lost before its deadline"
        assert lost_at < deadline + 0.25, f"marked lost {lost_at - deadline:.3f}s late"
        assert lost_at - paused_at < 2.3
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


# --------------------------------------------------------------------------- transient errors


class FlakyBackend(MemoryBackend):
    """A memory backend whose next `failures` extension round trips time out."""

    def __init__(self, *, clock: Any, failures: int) -> None:
        super().__init__(clock=clock)
        self.failures = failures
        self.calls = 0

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise BackendUnavailable("timed out (test)")
        return super()._extend_many(items)


def test_transient_extension_error_is_retried_not_lost(keeper_factory: Any) -> None:
    clock = ManualClock()
    backend = FlakyBackend(clock=clock, failures=2)
    lease = _take(backend, "blip", 3.0)
    losses = LossLog()
    keeper = keeper_factory(clock=clock, on_lost=losses)
    _manual(keeper, [lease])

    clock.advance(1.0)
    wait = keeper.tick()  # times out: retried soon, not lost
    assert backend.calls == 1 and not lease.lost and not losses.calls
    assert wait < 0.5, "a failed extension must be retried well before the next interval"
    clock.advance(wait)
    keeper.tick()  # times out again
    assert backend.calls == 2 and not lease.lost
    clock.advance(keeper.tick())  # the server answers again
    keeper.tick()
    assert backend.calls == 3
    assert lease.held and not losses.calls
    assert lease.deadline == pytest.approx(clock.now + 3.0, abs=0.5)
    for _ in range(10):  # and it goes on being kept
        clock.advance(1.0)
        keeper.tick()
    assert lease.held


def test_failing_backend_loses_its_leases_at_the_deadline_not_before(
    keeper_factory: Any,
) -> None:
    clock = ManualClock()
    backend = BrokenBackend(clock=clock)
    lease = _take(backend, "down", 3.0)
    losses = LossLog()
    keeper = keeper_factory(clock=clock, on_lost=losses)
    _manual(keeper, [lease])
    deadline = lease.deadline
    while clock.now < deadline - lease.drift - 0.01:
        clock.advance(min(keeper.tick(), 0.2))
        assert not losses.calls, f"lost {deadline - clock.now:.3f}s before its deadline"
    clock.advance(0.02)
    keeper.tick()
    assert len(losses.calls) == 1 and "deadline" in str(losses.calls[0][1])


class RefusingBackend(MemoryBackend):
    """Refuses the extension of the keys in `refused` (another owner), extends the rest."""

    refused: set[str] = set()

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        return [k not in self.refused and self._extend(k, o, t) for k, o, t in items]


def test_refusal_of_one_lease_in_a_batch_spares_the_others(keeper_factory: Any) -> None:
    clock = ManualClock()
    backend = RefusingBackend(clock=clock)
    backend.refused = {"taken"}
    leases = [_take(backend, k, 3.0) for k in ("taken", "fine-1", "fine-2")]
    losses = LossLog()
    keeper = keeper_factory(clock=clock, on_lost=losses)
    _manual(keeper, leases)
    clock.advance(1.0)
    keeper.tick()
    assert [c[0].key for c in losses.calls] == ["taken"]
    assert isinstance(losses.calls[0][1], NotOwner)
    assert [le.key for le in leases if le.held] == ["fine-1", "fine-2"]


# --------------------------------------------------------------------------- real Redis faults


class StallOnExtend(RedisBackend):
    """A RedisBackend that, once armed, runs `stall` just as it sends an extension."""

    stall: Callable[[], None] | None = None

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        stall, self.stall = self.stall, None
        if stall is not None:
            stall()
        return super()._extend_many(items)


def test_heartbeat_timeout_during_a_short_stall_keeps_the_lease_and_the_job_runs_once(
    fresh_redis: RedisServer, keeper_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A 0.6 s server stall with a 0.3 s socket timeout: one heartbeat times out, no loss.

    The stall starts just as an extension is sent, so that extension surely times out.
    """
    from jobfence.locks import Backoff
    from jobfence.tasks import Executor
    from tests.tasks.conftest import spec_for

    backend = StallOnExtend.from_url(fresh_redis.url, socket_timeout=0.3)
    losses, extends = LossLog(), ExtendLog()
    keeper = keeper_factory(on_lost=losses, on_extend=extends)
    executor = Executor(backend, keeper, backoff=Backoff(0.005, 0.05))
    runs: list[int] = []
    resumed = threading.Event()

    def stall() -> None:
        fresh_redis.pause()

        def resume() -> None:
            fresh_redis.resume()
            resumed.set()

        threading.Timer(0.6, resume).start()

    def body(ctx: Any) -> int:
        runs.append(ctx.fence)
        backend.stall = stall  # the next extension meets a 0.6 s stall
        assert resumed.wait(10.0), "the stall never happened"
        seen = len(extends.calls)
        wait_for(lambda: len(extends.calls) > seen, 5.0, message="no extension after the stall")
        ctx.check()  # the lease is still ours
        return ctx.fence

    key = _key("stall")
    with caplog.at_level("WARNING", logger="jobfence.locks.keeper"):
        out = executor.run(spec_for(key, ttl=2.0), body)
    assert any("lease extension failed" in r.getMessage() for r in caplog.records), (
        "no extension timed out during the stall: the fault did not bite"
    )
    assert not losses.calls, [str(c[1]) for c in losses.calls]
    assert (out.status, runs) == ("ran", [out.fence])
    record = backend.job_record(key)
    assert record is not None and record.state == "DONE" and record.fence == out.fence
    backend.close()


def test_a_hung_backend_never_delays_another_backends_extensions(
    fresh_redis: RedisServer, redis_url: str, keeper_factory: Any
) -> None:
    """Extensions of a healthy server go on while another server hangs for a second a call."""
    hung = RedisBackend.from_url(fresh_redis.url, socket_timeout=1.0)
    healthy = RedisBackend.from_url(redis_url, socket_timeout=0.3)
    losses, extends = LossLog(), ExtendLog()
    keeper = keeper_factory(on_lost=losses, on_extend=extends)
    stuck = _take(hung, _key("stuck"), 3.0)
    kept = [_take(healthy, _key("kept"), 0.6) for _ in range(3)]
    for lease in (stuck, *kept):
        keeper.keep(lease)
    wait_for(lambda: any(n == "redis" for n, _, _ in extends.calls), 5.0)
    fresh_redis.pause()
    try:
        until = time.monotonic() + 2.5  # several hung calls, four TTLs of the healthy leases
        while time.monotonic() < until:
            assert all(le.held for le in kept), "a healthy lease was lost behind a hung server"
            time.sleep(0.02)
        assert [c[0] for c in losses.calls if c[0] is not stuck] == []
        for lease in kept:
            info = healthy.inspect(lease.key)
            assert info is not None and info.fence == lease.fence
    finally:
        fresh_redis.resume()
    hung.close()
    healthy.close()


class CountingRedis(RedisBackend):
    """A RedisBackend that counts how often each key is sent in an extension."""

    extended: collections.Counter[str]

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        self.extended.update(k for k, _, _ in items)
        return super()._extend_many(items)


def test_extension_period_is_a_third_of_the_ttl_while_jobs_come_and_go(
    redis_url: str, keeper_factory: Any
) -> None:
    """One extension per TTL/3 per lease, even with other jobs starting all the time.

    Jobs overlapping at every phase used to pull each other's extensions early (anything
    due within half an interval went along), so a lease was extended up to every TTL/6.
    """
    backend = CountingRedis.from_url(redis_url, socket_timeout=0.3)
    backend.extended = collections.Counter()
    keeper = keeper_factory()
    ttl, span, job_length = 0.6, 3.0, 0.5
    key = _key("period")
    lease = _take(backend, key, ttl)
    keeper.keep(lease)
    started = time.monotonic()
    running: list[tuple[float, Lease]] = []
    while time.monotonic() - started < span:  # a job starts every 40 ms and runs 0.5 s
        other = _take(backend, _key("churn"), ttl)
        keeper.keep(other)
        running.append((time.monotonic(), other))
        time.sleep(0.04)
        while running and time.monotonic() - running[0][0] > job_length:
            _, done = running.pop(0)
            keeper.drop(done)
            done.release()
    elapsed = time.monotonic() - started
    count = backend.extended[key]
    expected = elapsed / (ttl / 3)
    assert lease.held and all(le.held for _, le in running)
    assert 0.75 * expected <= count <= 1.1 * expected + 1, (
        f"{count} extensions in {elapsed:.2f}s; every TTL/3 is {expected:.1f}"
    )
    backend.close()


def test_one_broken_lock_in_a_batch_does_not_cost_the_others_their_leases(
    redis_url: str, redis_client: Any, keeper_factory: Any
) -> None:
    """A lock key overwritten with another type is refused alone; the batch goes through."""
    backend = RedisBackend.from_url(redis_url, socket_timeout=0.3)
    losses = LossLog()
    keeper = keeper_factory(on_lost=losses)
    leases = [_take(backend, _key("batch"), 0.6) for _ in range(3)]
    broken = leases[1]
    redis_client.set(backend.keys.lock(broken.key), "not a lock hash")
    for lease in leases:
        keeper.keep(lease)
    assert losses.event.wait(5.0), "the overwritten lock was never refused"
    until = time.monotonic() + 1.5  # more than two TTLs
    while time.monotonic() < until:
        assert leases[0].held and leases[2].held
        time.sleep(0.05)
    assert [c[0] for c in losses.calls] == [broken]
    assert isinstance(losses.calls[0][1], NotOwner)
    backend.close()


class BatchLog(RedisBackend):
    """A RedisBackend that records the size of every extend_many batch it sends."""

    batches: list[int]

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        self.batches.append(len(items))
        return super()._extend_many(items)


def test_thousands_of_leases_taken_over_time_are_renewed_in_one_call_per_interval(
    redis_url: str, keeper_factory: Any
) -> None:
    """Leases taken at every phase of the interval share one extend_many call after that.

    Control: the keeper that batched only the leases falling due together sent them in
    many calls of a few leases each, every interval (measured: 28, then 180 of 2,000).
    """
    backend = BatchLog.from_url(redis_url, socket_timeout=2.0)
    backend.batches = []
    losses = LossLog()
    keeper = keeper_factory(on_lost=losses)
    n, ttl = 2_000, 3.0  # the bench keeps 10,000; the count does not change the schedule
    leases = []
    for i in range(n):
        lease = _take(backend, f"many:{i}", ttl)
        keeper.keep(lease)
        leases.append(lease)
    taken = len(backend.batches)
    wait_for(lambda: len(backend.batches) >= taken + 3, timeout=20.0,
             message="the keeper sent no three batches")  # fmt: skip
    after = backend.batches[taken + 1 : taken + 3]  # the one in flight may predate the last take
    assert after == [n, n], f"batches after all leases were taken: {backend.batches[taken:]}"
    assert not losses.calls and all(le.held for le in leases)
    backend.close()


def test_a_batch_above_the_chunk_size_goes_as_several_scripts_in_one_write(
    redis_url: str, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No script holds the server for a whole big batch, and the batch is one round trip."""
    backend = RedisBackend.from_url(redis_url)
    leases = [_take(backend, f"chunk:{i}", 30.0) for i in range(2 * EXTEND_CHUNK + 1)]
    assert backend.extend_many(leases[:1]) == [True]  # the script is loaded
    assert backend._lane is not None and len(backend._lane.idle) == 1
    conn = backend._lane.idle[0]
    writes: list[int] = []
    send = conn.send_packed_command

    def counted(commands: Any, check_health: bool = True) -> None:
        writes.append(len(commands))
        send(commands, check_health)

    monkeypatch.setattr(conn, "send_packed_command", counted)
    scripts = int(redis_client.info("commandstats")["cmdstat_evalsha"]["calls"])
    assert backend.extend_many(leases) == [True] * len(leases)
    assert writes == [3], "one write carrying three scripts"
    assert int(redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]) - scripts == 3
    backend.close()


def test_an_evicted_lease_is_heard_at_once_where_watched(
    redis_url: str, keeper_factory: Any
) -> None:
    """Supersede's eviction (`release_grant`, by the grant's fence) is announced on Redis,
    and a keeper that watches hears it and extends the lease now: lost within moments, not
    at its next extension (10 s away with a TTL of 30 s). The control, in the same test: a
    lease evicted alike on a backend no keeper watches (another key prefix, so another
    channel) is still believed held."""
    backend = RedisBackend.from_url(redis_url, socket_timeout=0.3)
    other = RedisBackend.from_url(redis_url, socket_timeout=0.3, prefix=_key("unwatched"))
    keeper = keeper_factory()
    watched, unwatched = _take(backend, _key("watched"), 30.0), _take(other, _key("plain"), 30.0)
    lost = {"watched": threading.Event(), "unwatched": threading.Event()}
    watched.on_lost(lambda _lease, _cause: lost["watched"].set())
    unwatched.on_lost(lambda _lease, _cause: lost["unwatched"].set())
    keeper.keep(watched, watch=True)
    keeper.keep(unwatched)
    watch = keeper._watches[id(backend)]
    assert watch is not None and watch.subscribed.wait(5.0), "the watcher never subscribed"
    assert other.release_grant(unwatched.key, unwatched.fence)
    assert backend.release_grant(watched.key, watched.fence)
    assert lost["watched"].wait(5.0), "the watched lease was not found lost at the notice"
    assert not lost["unwatched"].is_set() and unwatched.held, "lost without a notice?"
    with pytest.raises(LeaseLost):
        watched.check()
    keeper.stop()
    assert not watch._thread.is_alive(), "the watcher outlived its keeper"
    backend.close()
    other.close()


def test_a_notice_names_a_fence_and_a_key() -> None:
    from jobfence.locks.backends.redis.evictions import notice, parse_notice

    assert parse_notice(notice(42, "t.job:ab12")) == ("t.job:ab12", 42)
    assert parse_notice(notice(7, "key with space").encode()) == ("key with space", 7)
    for junk in ("", "42", "x key", " key"):
        assert parse_notice(junk) is None


def test_an_acl_user_without_the_channel_still_evicts_and_is_told_why(
    fresh_redis: RedisServer, keeper_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis 7 gives a new ACL user no pub/sub channel: the eviction still lands (its
    notice is dropped in the script), and the watcher stops, saying which grant it needs."""
    admin = fresh_redis.client()
    admin.execute_command("ACL", "SETUSER", "worker", "on", ">worker-pw", "~*", "+@all",
                          "resetchannels")  # fmt: skip
    url = fresh_redis.url.replace("redis://", "redis://worker:worker-pw@", 1)
    backend = RedisBackend.from_url(url, socket_timeout=0.3)
    keeper = keeper_factory()
    lease = _take(backend, _key("acl"), 30.0)
    with caplog.at_level("WARNING", logger="jobfence.locks.backends.redis.evictions"):
        keeper.keep(lease, watch=True)
        watch = keeper._watches[id(backend)]
        assert watch is not None
        watch._thread.join(5.0)
        assert not watch._thread.is_alive(), "the watcher kept trying without permission"
    assert "may not subscribe" in caplog.text and "worker-pw" not in caplog.text
    assert backend.release_grant(lease.key, lease.fence), "the eviction itself was refused"
    assert backend.inspect(lease.key) is None
    keeper.stop()
    backend.close()
    admin.close()
