"""The LockBackend contract: exclusion, owner checks, expiry, fencing, records, waiting."""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import queue
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jobfence.locks import (
    AcquireTimeout,
    BackendUnavailable,
    Backoff,
    Busy,
    JobRecord,
    Lease,
    LeaseLost,
    LockBackend,
    LockError,
    LockInfo,
    NotOwner,
    OwnerMeta,
    acquire,
)
from jobfence.locks.lease import new_owner_token
from jobfence.locks.procinfo import process_start
from tests.contract.conftest import BackendHarness, run_racers
from tests.servers import wait_for

PROCESSES = 50
ROUNDS_PER_PROCESS = 3


def _key(name: str) -> str:
    return f"{name}:{uuid.uuid4().hex[:8]}"


def _stranger(lease: Lease) -> Lease:
    """A lease object for the same key and fence, but with another owner token."""
    return Lease(
        key=lease.key,
        owner=new_owner_token(),
        fence=lease.fence,
        ttl=lease.ttl,
        deadline=lease.deadline,
        backend=lease.backend,
        clock=lease.clock,
    )


def _info(backend: LockBackend, key: str) -> LockInfo:
    info = backend.inspect(key)
    assert info is not None, f"{key} is not held"
    return info


# --------------------------------------------------------------------------- mutual exclusion


def _racer(
    connect: Callable[[], LockBackend],
    key: str,
    counter: str,
    rounds: int,
    go: Any,
    out: Any,
) -> None:
    """One racing process: acquire, record the hold interval, bump a file counter, release."""
    try:
        backend = connect()
        if not go.wait(30):
            raise RuntimeError("start signal never came")
        for _ in range(rounds):
            lease = acquire(backend, key, ttl=10.0, timeout=60.0, backoff=Backoff(0.002, 0.05))
            start = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process
            path = Path(counter)
            value = int(path.read_text())  # a read-modify-write that loses updates if shared
            time.sleep(0.001)
            path.write_text(str(value + 1))
            end = time.monotonic_ns()
            released = lease.release()
            out.put(("hold", os.getpid(), lease.fence, start, end, released))
        out.put(("done", os.getpid()))
    except BaseException as exc:
        out.put(("error", os.getpid(), repr(exc)))


def test_mutual_exclusion_across_racing_processes(
    multiprocess: BackendHarness, tmp_path: Path
) -> None:
    assert multiprocess.connect is not None
    key = _key("race")
    counter = tmp_path / "counter"
    counter.write_text("0")
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_racer,
            args=(multiprocess.connect, key, str(counter), ROUNDS_PER_PROCESS, go, out),
            daemon=True,
        )
        for _ in range(PROCESSES)
    ]
    holds: list[tuple[int, int, int, int, bool]] = run_racers(procs, go, out)

    assert len(holds) == PROCESSES * ROUNDS_PER_PROCESS
    assert all(released for *_, released in holds), "a holder could not release its own lock"
    holds.sort(key=lambda h: h[2])  # by start time
    for before, after in itertools.pairwise(holds):
        assert after[2] >= before[3], f"hold intervals overlap: {before} and {after}"
        assert after[1] > before[1], f"fence did not increase in hold order: {before}, {after}"
    assert int(counter.read_text()) == PROCESSES * ROUNDS_PER_PROCESS
    assert len({h[0] for h in holds}) == PROCESSES


def test_mutual_exclusion_across_threads(harness: BackendHarness) -> None:
    key = _key("threads")
    clients = [harness.another_client() for _ in range(8)]
    holds: list[tuple[int, int, int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(clients))

    def run(backend: LockBackend) -> None:
        try:
            barrier.wait(10)
            for _ in range(10):
                with acquire(backend, key, ttl=10.0, timeout=30.0) as lease:
                    start = time.monotonic_ns()
                    time.sleep(0.0005)
                    holds.append((lease.fence, start, time.monotonic_ns()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    holds.sort(key=lambda h: h[1])
    for before, after in itertools.pairwise(holds):
        assert after[1] >= before[2], f"overlap: {before} {after}"
        assert after[0] > before[0]
    assert len(holds) == 80


# --------------------------------------------------------------------------- owner checks


def test_stranger_cannot_release_or_extend(backend: LockBackend) -> None:
    key = _key("owner")
    holder = backend.try_acquire(key, 10.0)
    assert holder is not None
    before = _info(backend, key)
    stranger = _stranger(holder)

    assert backend.release(stranger) is False
    with pytest.raises(NotOwner):
        backend.extend(stranger, 100.0)
    assert stranger.lost
    with pytest.raises(LeaseLost):
        stranger.check()
    other = _stranger(holder)
    assert backend.extend_many([other]) == [False]
    assert other.lost

    after = _info(backend, key)
    assert after.fence == holder.fence == before.fence
    assert after.ttl_left <= 10.0, "a stranger's extension reset the TTL"
    assert after.last_heartbeat == before.last_heartbeat
    assert holder.held and not holder.lost
    assert backend.release(holder) is True
    assert backend.inspect(key) is None


def test_an_admin_release_removes_only_the_grant_it_judged(backend: LockBackend) -> None:
    """`release_grant(key, fence)`: the operator's orphan release, owner-checked by fence."""
    key = _key("judged")
    judged = backend.try_acquire(key, 10.0)
    assert judged is not None
    assert backend.force_release(key)
    newer = backend.try_acquire(key, 10.0)  # the lock changed hands after it was judged
    assert newer is not None and newer.fence > judged.fence
    assert backend.release_grant(key, judged.fence) is False
    assert _info(backend, key).fence == newer.fence
    assert backend.release_grant(key, newer.fence) is True
    assert backend.inspect(key) is None
    assert backend.release_grant(key, newer.fence) is False  # nothing held any more


def test_an_admin_release_never_takes_a_grant_made_while_it_looked(
    backend: LockBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release_grant that looks (inspect) before it removes gets a new grant made in
    between, deterministically; the fence check must sit in the removal and spare it."""
    key = _key("interleaved")
    judged = backend.try_acquire(key, 10.0)
    assert judged is not None
    newer: list[Lease] = []
    look = backend._inspect

    def look_then_regrant(k: str) -> LockInfo | None:
        seen = look(k)
        if k == key and not newer:  # the judged lease ends, and another worker takes the key
            monkeypatch.setattr(backend, "_inspect", look)
            assert backend.force_release(k)
            got = backend.try_acquire(k, 10.0)
            assert got is not None
            newer.append(got)
        return seen

    monkeypatch.setattr(backend, "_inspect", look_then_regrant)
    removed = backend.release_grant(key, judged.fence)
    monkeypatch.setattr(backend, "_inspect", look)
    if newer:  # it looked first: the grant made meanwhile survives
        assert removed is False, "release_grant removed a grant made after it looked"
        assert _info(backend, key).fence == newer[0].fence
        assert backend.release(newer[0]) is True
    else:  # no look at all: the removal itself judged the fence
        assert removed is True
        assert backend.inspect(key) is None


def test_busy_key_is_refused_with_time_left(backend: LockBackend) -> None:
    key = _key("busy")
    holder = backend.try_acquire(key, 10.0)
    assert holder is not None
    assert backend.try_acquire(key, 10.0) is None
    busy = backend.attempt(key, 10.0)
    assert isinstance(busy, Busy)
    assert 0 < busy.ttl_left <= 10.0
    assert _info(backend, key).fence == holder.fence


# --------------------------------------------------------------------------- expiry


def test_expired_lease_goes_to_next_owner_with_higher_fence(harness: BackendHarness) -> None:
    backend, other = harness.backend, harness.another_client()
    key = _key("expiry")
    old = backend.try_acquire(key, 0.8)  # 0.3 s lapsed before the next call on a loaded CI
    assert old is not None
    assert other.try_acquire(key, 10.0) is None

    new = wait_for(lambda: other.try_acquire(key, 10.0), timeout=5.0, message="never expired")
    assert new.fence > old.fence
    assert old.lost
    with pytest.raises(LeaseLost):
        old.check()
    with pytest.raises(LeaseLost):
        old.extend()
    with pytest.raises(NotOwner):
        backend.extend(old, 10.0)
    assert backend.extend_many([old]) == [False]
    assert old.release() is False
    assert backend.release(old) is False

    info = _info(backend, key)
    assert info.fence == new.fence, "the old lease's release freed the new holder's lock"
    assert new.held
    assert new.release() is True


# --------------------------------------------------------------------------- fencing tokens


def test_fence_strictly_increases_over_1000_grants(backend: LockBackend) -> None:
    key = _key("fence")
    fences = []
    for _ in range(1000):
        lease = backend.try_acquire(key, 5.0)
        assert lease is not None
        fences.append(lease.fence)
        assert lease.release()
    assert all(a < b for a, b in itertools.pairwise(fences))


def _acquire_after_outage(backend: LockBackend, key: str) -> Lease:
    def attempt() -> Lease | None:
        try:
            return backend.try_acquire(key, 5.0)
        except BackendUnavailable:  # the first call may meet the dead connection
            return None

    return wait_for(attempt, timeout=10.0, message="no grant after restart")


def _release_after_outage(lease: Lease) -> bool:
    """The stale holder's release, asked again while masters still answer with dead connections."""

    def attempt() -> tuple[bool] | None:
        try:
            return (lease.release(),)
        except BackendUnavailable:  # a restarted master's old connection, or a late reply
            return None

    return wait_for(attempt, timeout=10.0, message="no answer to the release after restart")[0]


def test_fence_strictly_increases_across_data_loss(harness: BackendHarness) -> None:
    backend = harness.backend
    if not backend.capabilities.durable_fence or harness.lose_data is None:
        pytest.skip(f"{harness.name}: fences are not durable across data loss")
    key = _key("restart")
    fences = []
    for _ in range(200):
        lease = backend.try_acquire(key, 5.0)
        assert lease is not None
        fences.append(lease.fence)
        assert lease.release()
    held = backend.try_acquire(key, 30.0)
    assert held is not None
    fences.append(held.fence)

    harness.lose_data()

    # The lock and its counter are gone: a new owner gets it at once, with a higher fence.
    after = _acquire_after_outage(backend, key)
    assert after.fence > fences[-1]
    assert _release_after_outage(held) is False
    fences.append(after.fence)
    assert after.release()
    for _ in range(100):
        lease = backend.try_acquire(key, 5.0)
        assert lease is not None
        fences.append(lease.fence)
        assert lease.release()
    assert all(a < b for a, b in itertools.pairwise(fences))


# --------------------------------------------------------------------------- extend_many


def test_extend_many_is_one_round_trip_and_owner_checked(harness: BackendHarness) -> None:
    backend, other = harness.backend, harness.another_client()
    base = _key("many")
    ttl = 3.0
    mine = [backend.try_acquire(f"{base}:{i}", ttl) for i in range(3)]
    assert all(mine)
    leases: list[Lease] = [le for le in mine if le is not None]
    gone = backend.try_acquire(f"{base}:gone", ttl)
    assert gone is not None
    assert backend.force_release(gone.key)
    thief = other.try_acquire(gone.key, ttl)
    assert thief is not None
    backend.extend_many(leases[:1])  # warm-up: the script is loaded on first use

    wait_for(
        lambda: all(_info(backend, le.key).ttl_left < ttl - 0.3 for le in leases),
        timeout=5.0,
        message="TTLs did not run down",
    )
    remaining_before = [le.remaining() for le in leases]
    results, trips = harness.round_trips(
        lambda: backend.extend_many([leases[0], gone, leases[1], leases[2]])
    )
    assert trips in (None, 1), f"extend_many took {trips} round trips"

    assert results == [True, False, True, True]
    assert gone.lost
    with pytest.raises(LeaseLost) as lost:
        gone.check()
    assert isinstance(lost.value.cause, NotOwner)
    for lease, before in zip(leases, remaining_before, strict=True):
        assert not lease.lost
        assert lease.remaining() > before
        assert _info(backend, lease.key).ttl_left > ttl - 0.3
    assert _info(backend, thief.key).fence == thief.fence
    assert backend.extend_many([]) == []


# --------------------------------------------------------------------------- inspect


def test_inspect_reports_holder_but_never_owner_token(backend: LockBackend) -> None:
    key = _key("inspect")
    assert backend.inspect(key) is None
    meta = OwnerMeta(host="worker-7.example", pid=4242, task_id="task-abc", task_name="jobs.pay")
    lease = backend.try_acquire(key, 10.0, meta=meta)
    assert lease is not None
    info = _info(backend, key)
    assert (info.key, info.host, info.pid, info.task_id, info.task_name) == (
        key,
        "worker-7.example",
        4242,
        "task-abc",
        "jobs.pay",
    )
    assert info.fence == lease.fence
    assert info.process_start == ""  # none given in meta
    assert 0 < info.ttl_left <= 10.0
    assert abs(info.acquired_at - time.time()) < 60
    assert info.last_heartbeat >= info.acquired_at

    wait_for(lambda: time.time() > info.last_heartbeat + 0.005, timeout=1.0)
    backend.extend(lease)
    after = _info(backend, key)
    assert after.last_heartbeat > info.last_heartbeat
    assert (after.fence, after.acquired_at) == (info.fence, info.acquired_at)

    scanned = [i for i in backend.scan("inspect:*") if i.key == key]
    assert scanned and scanned[0].fence == lease.fence

    texts = [repr(lease), str(lease), repr(info), str(info), repr(after), repr(scanned)]
    texts += [str(getattr(i, f.name)) for i in (info, after) for f in dataclasses.fields(i)]
    try:
        backend.extend(_stranger(lease))
    except NotOwner as exc:
        texts.append(str(exc))
    for text in texts:
        assert lease.owner not in text


def test_inspect_reports_the_holders_process_start(backend: LockBackend) -> None:
    """The orphan finder tells a holder from a later process that reused its pid by this."""
    key = _key("inspect")
    lease = backend.try_acquire(key, 10.0)  # the default meta: this process
    assert lease is not None
    info = _info(backend, key)
    assert (info.pid, info.process_start) == (os.getpid(), process_start(os.getpid()))
    assert info.process_start.count("/") == 2  # boot id / pid namespace / start ticks


def test_default_meta_names_this_host_and_process(backend: LockBackend) -> None:
    key = _key("meta")
    lease = backend.try_acquire(key, 10.0)
    assert lease is not None
    info = _info(backend, key)
    assert (info.host, info.pid) == (socket.gethostname(), os.getpid())


# --------------------------------------------------------------------------- job records


def test_done_record_short_circuits_begin(backend: LockBackend) -> None:
    key = _key("done")
    lease = backend.begin(key, 10.0, record=True, fingerprint="fp-1")
    assert isinstance(lease, Lease)
    assert backend.job_record(key) is None  # RUNNING is not a final record
    assert backend.commit(
        lease, state="DONE", result='{"paid": 42}', fingerprint="fp-1", result_ttl=60.0
    )
    assert backend.inspect(key) is None, "commit did not release"

    again = backend.begin(key, 10.0, record=True, fingerprint="fp-1")
    assert isinstance(again, JobRecord)
    assert (again.state, again.result, again.fingerprint, again.fence) == (
        "DONE",
        '{"paid": 42}',
        "fp-1",
        lease.fence,
    )
    assert abs(again.finished_at - time.time()) < 60
    assert backend.inspect(key) is None, "a DONE short-circuit took the lock"
    assert backend.job_record(key) == again

    # A plain lock on the same key ignores job records.
    plain = backend.begin(key, 10.0)
    assert isinstance(plain, Lease) and plain.fence > lease.fence
    assert plain.release()


def test_failed_record_does_not_short_circuit_begin(backend: LockBackend) -> None:
    key = _key("failed")
    first = backend.begin(key, 10.0, record=True, fingerprint="fp")
    assert isinstance(first, Lease)
    assert backend.commit(first, state="FAILED", result='"boom"', fingerprint="fp", result_ttl=60)
    record = backend.job_record(key)
    assert record is not None and record.state == "FAILED"

    retry = backend.begin(key, 10.0, record=True, fingerprint="fp")
    assert isinstance(retry, Lease)
    assert retry.fence > first.fence
    assert isinstance(backend.begin(key, 10.0, record=True, fingerprint="fp"), Busy)
    assert backend.commit(retry, state="DONE", result="1", fingerprint="fp", result_ttl=60)
    done = backend.job_record(key)
    assert done is not None and (done.state, done.fence) == ("DONE", retry.fence)


# --------------------------------------------------------------------------- publish claims


def test_claim_publish_keeps_the_first_task_id_until_cleared(backend: LockBackend) -> None:
    key = _key("claim")
    assert backend.claim_publish(key, "t1", 30.0) is None
    assert backend.claim_publish(key, "t1", 30.0) is None  # the same task again
    assert backend.claim_publish(key, "t2", 30.0) == "t1"
    backend.clear_publish(key)
    assert backend.claim_publish(key, "t2", 30.0) is None


def test_swap_publish_hands_a_claim_over_only_from_the_expected_holder(
    harness: BackendHarness,
) -> None:
    backend, other = harness.backend, harness.another_client()
    key = _key("swap")
    assert backend.swap_publish(key, "t1", "t1", 30.0) is None  # free: claimed
    assert other.claim_publish(key, "t9", 30.0) == "t1"
    assert other.swap_publish(key, "t1", "t2", 30.0) is None  # replaced
    assert backend.claim_publish(key, "t9", 30.0) == "t2"
    assert backend.swap_publish(key, "t1", "t3", 30.0) == "t2"  # t1 no longer holds it
    assert other.claim_publish(key, "t9", 30.0) == "t2", "a refused swap changed the claim"
    assert backend.swap_publish(key, "t2", "!t2", 30.0) is None  # marked started
    assert other.swap_publish(key, "t2", "!t2", 30.0) is None  # already so: the same answer
    assert other.swap_publish(key, "t2", "t4", 30.0) == "!t2", "replaced a started job"


def test_swap_publish_to_none_is_an_owner_checked_clear(harness: BackendHarness) -> None:
    backend, other = harness.backend, harness.another_client()
    key = _key("swapclear")
    assert backend.swap_publish(key, "t1", None, 30.0) is None  # nothing to clear
    assert backend.claim_publish(key, "t1", 30.0) is None
    assert other.swap_publish(key, "t2", None, 30.0) == "t1", "cleared another's claim"
    assert backend.claim_publish(key, "t3", 30.0) == "t1"
    assert other.swap_publish(key, "t1", None, 30.0) is None
    assert backend.claim_publish(key, "t3", 30.0) is None, "the claim was not cleared"
    with pytest.raises(LockError, match="swap_publish"):
        backend.swap_publish(key, "", "t1", 30.0)


def test_commit_by_non_owner_writes_nothing(harness: BackendHarness) -> None:
    backend, other = harness.backend, harness.another_client()
    key = _key("commit")
    holder = backend.begin(key, 10.0, record=True, fingerprint="fp")
    assert isinstance(holder, Lease)
    assert not backend.commit(
        _stranger(holder), state="DONE", result='"forged"', fingerprint="fp", result_ttl=60
    )
    assert backend.job_record(key) is None
    assert _info(backend, key).fence == holder.fence
    assert backend.commit(holder, state="DONE", result='"real"', fingerprint="fp", result_ttl=60)
    record = backend.job_record(key)
    assert record is not None and record.result == '"real"'

    # An expired holder's commit writes nothing and leaves the new holder alone.
    key2 = _key("commit-expired")
    old = backend.begin(key2, 0.3, record=True, fingerprint="fp")
    assert isinstance(old, Lease)

    def take() -> Lease | None:
        got = other.begin(key2, 10.0, record=True, fingerprint="fp")
        return got if isinstance(got, Lease) else None

    new = wait_for(take, timeout=5.0, message="old lease never expired")
    assert not backend.commit(old, state="DONE", result='"stale"', fingerprint="fp", result_ttl=60)
    assert backend.job_record(key2) is None
    assert _info(backend, key2).fence == new.fence
    assert other.commit(new, state="DONE", result='"new"', fingerprint="fp", result_ttl=60)
    record = backend.job_record(key2)
    assert record is not None and (record.result, record.fence) == ('"new"', new.fence)


# --------------------------------------------------------------------------- blocking acquire


def test_blocking_acquire_times_out(harness: BackendHarness) -> None:
    backend, other = harness.backend, harness.another_client()
    key = _key("timeout")
    holder = backend.try_acquire(key, 30.0)
    assert holder is not None

    started = time.monotonic()
    with pytest.raises(AcquireTimeout):
        acquire(other, key, ttl=5.0, timeout=0.5)
    elapsed = time.monotonic() - started
    assert elapsed >= 0.5
    assert elapsed < 10.0

    started = time.monotonic()
    with pytest.raises(AcquireTimeout):
        acquire(other, key, ttl=5.0, timeout=0)
    assert time.monotonic() - started < 5.0
    assert _info(backend, key).fence == holder.fence


class _MaxJitter(random.Random):
    """Always the longest backoff step, so only a wake-up can end a wait early."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_release_wakes_a_blocked_waiter(
    harness: BackendHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, other = harness.backend, harness.another_client()
    key = _key("wake")
    holder = backend.try_acquire(key, 30.0)
    assert holder is not None

    waiting = threading.Event()
    original = other.wait_for_release

    def spy(k: str, timeout: float) -> None:
        waiting.set()
        original(k, timeout)

    monkeypatch.setattr(other, "wait_for_release", spy)
    got: queue.Queue[tuple[float, Lease | BaseException]] = queue.Queue()

    def wait() -> None:
        try:
            slow = Backoff(base=10.0, cap=10.0, rng=_MaxJitter())
            lease = acquire(other, key, ttl=5.0, timeout=25.0, backoff=slow)
            got.put((time.monotonic(), lease))
        except BaseException as exc:
            got.put((time.monotonic(), exc))

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    assert waiting.wait(10), "the waiter never blocked"
    released_at = time.monotonic()
    assert holder.release()
    acquired_at, lease = got.get(timeout=20)
    thread.join(5)
    assert isinstance(lease, Lease), lease
    assert acquired_at - released_at < 5.0, "the waiter slept through the release"
    assert lease.fence > holder.fence
    assert lease.release()


def test_release_just_before_the_wait_is_not_missed(harness: BackendHarness) -> None:
    """A release between a waiter's refused attempt and its wait must still wake it."""
    backend, other = harness.backend, harness.another_client()
    key = _key("missed")
    holder = backend.try_acquire(key, 30.0)
    assert holder is not None
    assert isinstance(other.attempt(key, 5.0), Busy)  # the waiter's refused attempt
    assert holder.release()  # ... the release lands before it starts waiting
    started = time.monotonic()
    other.wait_for_release(key, 3.0)
    assert time.monotonic() - started < 1.0, "wait_for_release missed a release"
    assert other.try_acquire(key, 5.0) is not None


def test_health_asks_the_server_once_and_says_it_answered(harness: BackendHarness) -> None:
    health, trips = harness.round_trips(harness.backend.health)
    assert health.ok, health.detail
    assert 0 <= health.latency < 5.0 and health.detail
    assert trips is None or trips <= 1, f"health cost {trips} round trips"
