"""The semaphore contract: never more than N holders, arrival order, expiry, fences, refusals."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from jobfence.locks import AcquireTimeout, LeaseKeeper, LockBackend, Locker, RedisBackend
from jobfence.locks.backends.etcd import EtcdBackend
from jobfence.locks.backends.redis.semaphores import semaphore_keys
from jobfence.locks.backends.redlock import RedlockBackend
from jobfence.locks.backends.zookeeper import ZooKeeperBackend
from jobfence.locks.errors import SemaphoreUnsupported
from jobfence.locks.lease import new_owner_token
from jobfence.locks.semaphore import acquire_slot
from jobfence.locks.slots import SlotLease, SlotWait
from tests.contract.conftest import BACKENDS, BackendHarness, _harness, run_racers
from tests.servers import RedisServer, wait_for

#: The backends in the contract list that keep semaphores (capability `semaphore`).
SEMAPHORE_BACKENDS = ["redis", "memory", "postgres", "mariadb", "cluster", "sentinel", "valkey"]
#: The slow tests run once per implementation (Sentinel and Cluster run Redis's scripts).
RACE_BACKENDS = ["redis", "postgres", "mariadb", "valkey"]
#: The race: processes, slots, acquisitions per process (kept small: the suite is tight).
RACERS = 6
LIMIT = 2
ROUNDS = 30


@pytest.fixture(params=[b for b in BACKENDS if b in SEMAPHORE_BACKENDS])
def sem(request: pytest.FixtureRequest) -> Iterator[BackendHarness]:
    h = _harness(request.param, request)
    assert h.backend.capabilities.semaphore, f"{h.name} should keep semaphores"
    yield h
    h.close()


@pytest.fixture(params=RACE_BACKENDS)
def race(request: pytest.FixtureRequest) -> Iterator[BackendHarness]:
    h = _harness(request.param, request)
    yield h
    h.close()


@pytest.fixture
def sem_multi(sem: BackendHarness) -> BackendHarness:
    if not sem.multiprocess:
        pytest.skip(f"{sem.name} backend lives in one process")
    return sem


@pytest.fixture(scope="module")
def occupancy_server() -> Iterator[RedisServer]:
    """A Redis of its own where racers count who is inside (apart from any lock server)."""
    with RedisServer() as server:
        yield server


def _key(name: str) -> str:
    return f"{name}:{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------------------ the race


def _occupant(
    enter: Callable[[], Any],
    leave: Callable[[Any], None],
    occupancy_url: str,
    counter: str,
    rounds: int,
    go: Any,
    out: Any,
) -> None:
    """One racing process: enter, count itself in (INCR, recording the count it saw), hold
    briefly, count itself out (DECR), leave; report each hold with its interval."""
    try:
        occ = redis.Redis.from_url(occupancy_url)
        if not go.wait(30):
            raise RuntimeError("start signal never came")
        for _ in range(rounds):
            token = enter()
            start = time.monotonic_ns()
            seen = int(occ.incr(counter))
            time.sleep(0.002)
            occ.decr(counter)
            end = time.monotonic_ns()
            fence = token.fence if isinstance(token, SlotLease) else 0
            leave(token)
            out.put(("hold", os.getpid(), fence, start, end, seen))
        out.put(("done", os.getpid()))
    except BaseException as exc:
        out.put(("error", os.getpid(), repr(exc)))


def _race(
    make_enter_leave: Callable[[], tuple[Callable[[], Any], Callable[[Any], None]]],
    occupancy_url: str,
) -> list[tuple[int, int, int, int, int]]:
    """RACERS processes, ROUNDS holds each; returns (pid, fence, start, end, seen) per hold."""
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    counter = _key("occupancy")

    def run() -> None:
        enter, leave = make_enter_leave()  # in the child: its own connections
        _occupant(enter, leave, occupancy_url, counter, ROUNDS, go, out)

    procs = [ctx.Process(target=run, daemon=True) for _ in range(RACERS)]
    holds: list[tuple[int, int, int, int, int]] = run_racers(procs, go, out)
    return holds


def _most_at_once(holds: list[tuple[int, int, int, int, int]]) -> int:
    """The largest number of hold intervals open at one instant (one monotonic clock)."""
    events = sorted(
        [(start, 1) for _, _, start, _, _ in holds] + [(end, -1) for _, _, _, end, _ in holds],
        key=lambda e: (e[0], e[1]),  # at a tie an exit comes before an entry
    )
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_never_more_than_limit_holders_across_racing_processes(
    race: BackendHarness, occupancy_server: RedisServer
) -> None:
    assert race.connect is not None
    connect = race.connect
    key = _key("race")

    def enter_leave() -> tuple[Callable[[], Any], Callable[[Any], None]]:
        backend = connect()
        locker = Locker(backend, ttl=10.0, timeout=60.0)
        return (lambda: locker.acquire_slot(key, limit=LIMIT), locker.release)

    holds = _race(enter_leave, occupancy_server.url)

    seen_most = max(seen for *_, seen in holds)
    print(f"\nsemaphore race on {race.name}: {len(holds)} acquisitions by {RACERS} processes, "
          f"limit {LIMIT}: most inside at once {seen_most} (counter), "
          f"{_most_at_once(holds)} (intervals)")  # fmt: skip
    assert len(holds) == RACERS * ROUNDS
    assert seen_most <= LIMIT, "the occupancy counter saw N+1 inside"
    assert _most_at_once(holds) <= LIMIT, "more hold intervals than slots overlapped"
    assert _most_at_once(holds) == LIMIT, "the slots were never all used: the race proves little"
    fences = [fence for _, fence, *_ in holds]
    assert len(set(fences)) == len(fences), "two slot grants shared a fence"
    for pid in {h[0] for h in holds}:  # each process's grants come one after another
        mine = [fence for p, fence, *_ in sorted(holds, key=lambda h: h[2]) if p == pid]
        assert all(a < b for a, b in itertools.pairwise(mine)), f"fence went down in {pid}"


def test_control_a_check_then_increment_semaphore_overshoots(
    occupancy_server: RedisServer,
) -> None:
    """Without jobfence: a count read, compared and incremented in separate commands (the
    usual hand-rolled Redis semaphore) lets a third holder in under the same race."""
    url = occupancy_server.url
    gate = _key("naive")

    def enter_leave() -> tuple[Callable[[], Any], Callable[[Any], None]]:
        r = redis.Redis.from_url(url)

        def enter() -> None:
            while int(r.get(gate) or 0) >= LIMIT:
                time.sleep(0.001)
            r.incr(gate)

        return enter, lambda _token: r.decr(gate)

    holds = _race(enter_leave, url)

    over = [seen for *_, seen in holds if seen > LIMIT]
    print(f"\nnaive semaphore: {len(holds)} acquisitions, limit {LIMIT}: most inside at once "
          f"{max(seen for *_, seen in holds)}, {len(over)} entries over the limit")  # fmt: skip
    assert len(holds) == RACERS * ROUNDS
    assert over, "the naive semaphore never overshot"


# ------------------------------------------------------------------------------ semantics


def test_limit_holders_at_once_then_refused_with_time_left(sem: BackendHarness) -> None:
    b, key = sem.backend, _key("limit")
    slots = [b.semaphore_attempt(key, 3, 5.0) for _ in range(3)]
    assert all(isinstance(s, SlotLease) for s in slots)
    refused = b.semaphore_attempt(key, 3, 5.0)
    assert isinstance(refused, SlotWait)
    assert refused.position == -1  # a plain try takes no place in the queue
    assert 0 < refused.ttl_left <= 5.0
    assert len(b.semaphore_holders(key)) == 3
    assert isinstance(slots[0], SlotLease) and slots[0].release()
    assert isinstance(b.semaphore_attempt(key, 3, 5.0), SlotLease)


def test_waiters_are_admitted_in_arrival_order(sem: BackendHarness) -> None:
    b, key = sem.backend, _key("fifo")
    held = [b.semaphore_attempt(key, 2, 10.0) for _ in range(2)]
    waiters = [new_owner_token() for _ in range(4)]
    for i, owner in enumerate(waiters):
        got = b.semaphore_attempt(key, 2, 10.0, owner=owner, queue_ttl=10.0)
        assert isinstance(got, SlotWait) and got.position == i
    # A newcomer's plain try does not overtake the queue, even with a slot free.
    assert isinstance(held[0], SlotLease) and held[0].release()
    assert isinstance(b.semaphore_attempt(key, 2, 10.0), SlotWait)
    admitted = []
    for _ in range(4):
        # Polled latest first: only the one at the head may take the free slot.
        for owner in reversed([w for w in waiters if w not in admitted]):
            got = b.semaphore_attempt(key, 2, 10.0, owner=owner, queue_ttl=10.0)
            if isinstance(got, SlotLease):
                admitted.append(owner)
                got.release()
                break
    assert admitted == waiters


def test_a_waiter_that_stops_polling_loses_its_place(sem: BackendHarness) -> None:
    b, key = sem.backend, _key("lapse")
    held = b.semaphore_attempt(key, 1, 10.0)
    dead, alive = new_owner_token(), new_owner_token()
    assert isinstance(b.semaphore_attempt(key, 1, 10.0, owner=dead, queue_ttl=1.0), SlotWait)
    assert isinstance(b.semaphore_attempt(key, 1, 10.0, owner=alive, queue_ttl=5.0), SlotWait)
    assert isinstance(held, SlotLease) and held.release()
    # Until the dead waiter's place lapses it is owed the slot; then the next one gets it.
    assert isinstance(b.semaphore_attempt(key, 1, 10.0, owner=alive, queue_ttl=5.0), SlotWait)
    got = wait_for(
        lambda: isinstance(
            s := b.semaphore_attempt(key, 1, 10.0, owner=alive, queue_ttl=5.0), SlotLease
        ) and s,
        timeout=5,
        interval=0.05,
    )
    assert isinstance(got, SlotLease)


def test_a_waiter_that_times_out_leaves_the_queue(sem: BackendHarness) -> None:
    b, key = sem.backend, _key("leave")
    held = b.semaphore_attempt(key, 1, 10.0)
    with pytest.raises(AcquireTimeout, match="no semaphore slot"):
        acquire_slot(b, key, limit=1, ttl=10.0, timeout=0.2)
    assert isinstance(held, SlotLease) and held.release()
    assert isinstance(b.semaphore_attempt(key, 1, 10.0), SlotLease)  # nobody ahead any more


def test_fence_strictly_increases_per_key(sem: BackendHarness) -> None:
    b, key = sem.backend, _key("fence")
    fences = []
    for _ in range(50):
        slot = b.semaphore_attempt(key, 3, 5.0)
        assert isinstance(slot, SlotLease)
        fences.append(slot.fence)
        slot.release()
    assert all(a < b for a, b in itertools.pairwise(fences))


def test_fence_strictly_increases_across_data_loss(sem: BackendHarness) -> None:
    if sem.lose_data is None:
        pytest.skip(f"{sem.name} cannot lose its data here")
    if sem.name not in RACE_BACKENDS:
        pytest.skip(f"{sem.name} runs the script the redis case covers")
    b, key = sem.backend, _key("loss")
    before = b.semaphore_attempt(key, 2, 5.0)
    assert isinstance(before, SlotLease)
    sem.lose_data()
    after = wait_for(
        lambda: _try_slot(sem.another_client(), key), timeout=20, interval=0.2
    )
    assert after.fence > before.fence


def _try_slot(b: LockBackend, key: str) -> SlotLease | None:
    try:
        got = b.semaphore_attempt(key, 2, 5.0)
    except Exception:  # the server is coming back
        return None
    return got if isinstance(got, SlotLease) else None


def test_stranger_cannot_release_or_extend_a_slot(sem: BackendHarness) -> None:
    b, key = sem.backend, _key("stranger")
    slot = b.semaphore_attempt(key, 1, 5.0)
    assert isinstance(slot, SlotLease)
    assert b.semaphore_leave(key, new_owner_token()) is False
    stranger = SlotLease(key=key, owner=new_owner_token(), fence=slot.fence, ttl=5.0,
                         deadline=slot.deadline, backend=b, clock=b.clock, limit=1)  # fmt: skip
    assert b.extend_many([stranger]) == [False]
    assert stranger.lost
    assert len(b.semaphore_holders(key)) == 1
    assert slot.release() is True


def test_keeper_keeps_a_slot_past_its_ttl_beside_lock_leases(sem: BackendHarness) -> None:
    b, key = sem.backend, _key("kept")
    keeper = LeaseKeeper(clock=b.clock)
    assert b.semaphore_holders(key) == []  # made the tables: a 0.6 s lease outlives the call
    b.try_acquire(_key("warm"), 0.1)
    try:
        slot = b.semaphore_attempt(key, 1, 0.6)
        assert isinstance(slot, SlotLease)
        keeper.keep(slot)
        lock = b.try_acquire(_key("lock"), 0.6)
        assert lock is not None
        keeper.keep(lock)
        time.sleep(1.4)  # over two TTLs: only the keeper's extensions keep them
        assert slot.held and lock.held
        assert isinstance(b.semaphore_attempt(key, 1, 0.6), SlotWait)
        released = b.semaphore_attempt(key, 5, 0.6)  # a slot released behind the keeper's back
        assert isinstance(released, SlotLease)
        b.semaphore_leave(key, released.owner)
        assert b.extend_many([lock, slot, released]) == [True, True, False]
        assert released.lost and not slot.lost
    finally:
        keeper.stop()


@pytest.fixture(params=[b for b in BACKENDS if b in ("redis", "cluster", "sentinel", "valkey")])
def redis_sem(request: pytest.FixtureRequest) -> Iterator[BackendHarness]:
    """The backends that keep semaphores in expiring Redis keys (one set of scripts)."""
    h = _harness(request.param, request)
    yield h
    h.close()


def test_an_extension_keeps_a_held_slots_keys_past_their_retention(
    redis_sem: BackendHarness,
) -> None:
    """A slot held and renewed for longer than the keys' retention (24 h) keeps them: each
    extension pushes their expiry a retention past it, or a waiter would get in at once."""
    b, key = redis_sem.backend, _key("retained")
    assert isinstance(b, RedisBackend)
    slot = b.semaphore_attempt(key, 1, 30.0)
    assert isinstance(slot, SlotLease)
    names = semaphore_keys(b.keys.prefix, key)
    for name in names:  # as if the last grant was a retention ago, less 1.5 s
        b.client.pexpire(name, 1500)
    assert b.extend_many([slot]) == [True]
    time.sleep(2.5)  # past the 1.5 s the keys had left before the extension
    other = b.semaphore_attempt(key, 1, 30.0, owner=new_owner_token())
    assert isinstance(other, SlotWait), "a second holder got into a limit-1 semaphore"
    for name in (names[0], names[4]):  # slots, holders
        assert b.client.pttl(name) > b.semaphore_retention_ms - 60_000, name
    assert b.extend_many([slot]) == [True] and slot.held
    assert slot.release() is True


#: The crashed holder's lease: its keeper renews it at a third, so a loaded machine (CI's four
#: test workers) must leave the forked holder's keeper a few hundred ms to run; 0.8 s was short.
HOLDER_TTL = 2.0


def test_a_crashed_holders_slot_comes_back_when_its_lease_ends(race: BackendHarness) -> None:
    """A real holder process, its keeper running, is SIGKILLed; its slot returns within
    about one TTL, to a waiter that was queued meanwhile, with a higher fence."""
    assert race.connect is not None
    sem_multi, connect, key = race, race.connect, _key("crash")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()

    def hold() -> None:
        locker = Locker(connect(), ttl=HOLDER_TTL)
        slot = locker.acquire_slot(key, limit=1)
        out.put(slot.fence)
        time.sleep(60)

    holder = ctx.Process(target=hold, daemon=True)
    holder.start()
    try:
        dead_fence = out.get(timeout=20)
        time.sleep(HOLDER_TTL * 1.5)  # past its TTL: only its keeper keeps the slot now
        b = sem_multi.backend
        assert isinstance(b.semaphore_attempt(key, 1, 5.0), SlotWait), "the keeper let it lapse"
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)
        killed = time.monotonic()
        slot = acquire_slot(b, key, limit=1, ttl=5.0, timeout=10.0)
        waited = time.monotonic() - killed
    finally:
        holder.kill()
        holder.join(5)
    assert slot.fence > dead_fence
    # Within its TTL plus a poll (generous: the machine is shared); never held for ever.
    assert waited < HOLDER_TTL + 3.0, f"the slot came back {waited:.2f}s after the kill"
    slot.release()


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("cls", [EtcdBackend, ZooKeeperBackend, RedlockBackend])
def test_backends_without_semaphores_refuse_by_name(cls: type[LockBackend]) -> None:
    assert cls.capabilities.semaphore is False
    backend = object.__new__(cls)  # the refusal comes before any server is asked
    with pytest.raises(SemaphoreUnsupported, match=f"the {cls.name} lock backend") as err:
        backend.semaphore_attempt("k", 2, 5.0)
    assert "redis" in str(err.value) and "postgresql" in str(err.value)


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2"])
def test_a_bad_limit_is_refused_naming_it(limit: Any) -> None:
    from jobfence.locks import MemoryBackend

    with pytest.raises(Exception, match="semaphore limit must be an integer"):
        MemoryBackend().semaphore_attempt("k", limit, 5.0)
