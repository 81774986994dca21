"""The store contract: each op of locks/ops.py, by run_sync and by run_async, on every backend."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from jobfence.locks import AcquireTimeout, Busy, Lease, LockInfo
from jobfence.locks.backend import JobRecord, RateGrant
from jobfence.locks.drive import AsyncStore, Store, run_async, run_sync
from jobfence.locks.flows import Flow, acquire_flow
from jobfence.locks.lease import new_owner_token
from jobfence.locks.ops import (
    Acquire,
    Begin,
    ClaimPublish,
    ClearPublish,
    Commit,
    CountDelivery,
    Extend,
    Inspect,
    LeaveSlot,
    Now,
    Op,
    ReadRecord,
    Release,
    ReleaseOwner,
    Sleep,
    StoreOp,
    SwapPublish,
    TakeRate,
    TakeSlot,
    WaitRelease,
)
from jobfence.locks.slots import SlotLease, SlotWait
from tests.contract.conftest import StorePair

TTL = 30.0  # long: nothing in these tests may expire while they run
Run = Callable[[Flow[Any]], Any]


def _key(name: str) -> str:
    return f"{name}:{uuid.uuid4().hex[:8]}"


def one(op: Op) -> Flow[Any]:
    """A flow of one op: its reply is the flow's value."""
    return (yield op)


def _stranger(lease: Lease) -> Lease:
    """The same key, fence and kind of lease under another owner token."""
    extra = {"limit": lease.limit} if isinstance(lease, SlotLease) else {}
    return type(lease)(key=lease.key, owner=new_owner_token(), fence=lease.fence, ttl=lease.ttl,
                       deadline=lease.deadline, backend=lease.backend, clock=lease.clock,
                       **extra)  # fmt: skip


def _grant(run: Run, key: str, owner: str | None = None) -> Lease:
    got = run(one(Acquire(key, TTL, owner or new_owner_token())))
    assert isinstance(got, Lease), f"{key} not granted: {got!r}"
    return got


def _pairs(stores: StorePair, *, by_token: bool = False) -> list[tuple[str, Run, str, Run]]:
    """Every (holder, other) pair of drivers: sync/sync, sync/async, async/sync, async/async.

    `by_token`: the other store extends or releases by owner token alone. A ZooKeeper lease
    is an ephemeral node of the granting client's session, so there only that client can."""
    pairs = [(a, ra, b, rb) for a, ra in stores.drivers for b, rb in stores.drivers]
    if by_token and stores.name == "zookeeper":
        return [p for p in pairs if p[0] == p[2]]
    return pairs


def test_acquire_busy_and_release_are_owner_checked(stores: StorePair) -> None:
    for holder, run, other, other_run in _pairs(stores, by_token=True):
        where = f"{stores.name}: {holder} holder, {other} other"
        key = _key("owner-checked")
        lease = _grant(run, key)
        assert lease.fence > 0 and lease.key == key, where
        busy = other_run(one(Acquire(key, TTL, new_owner_token())))
        assert isinstance(busy, Busy) and 0 < busy.ttl_left <= TTL, where
        assert other_run(one(Release(_stranger(lease)))) is False, where
        assert other_run(one(ReleaseOwner(key, new_owner_token()))) is False, where
        assert isinstance(other_run(one(Acquire(key, TTL, new_owner_token()))), Busy), where
        assert other_run(one(Release(lease))) is True, where
        assert other_run(one(Release(lease))) is False, where  # released once only
        owner = new_owner_token()
        again = _grant(other_run, key, owner)
        assert again.fence > lease.fence, where
        assert run(one(ReleaseOwner(key, owner))) is True, where
        assert run(one(Inspect(key))) is None, where


def test_extend_is_one_batch_and_owner_checked(stores: StorePair) -> None:
    semaphore = stores.sync.capabilities.semaphore
    for holder, run, other, other_run in _pairs(stores, by_token=True):
        where = f"{stores.name}: {holder} holder, {other} extends"
        first, second = _grant(run, _key("extend-a")), _grant(run, _key("extend-b"))
        batch: list[Lease] = [first, second]
        if semaphore:
            slot = run(one(TakeSlot(_key("extend-slot"), 2, TTL, new_owner_token())))
            assert isinstance(slot, SlotLease), where
            batch.append(slot)
        strangers = [_stranger(lease) for lease in batch]
        before = [lease.deadline for lease in batch]
        assert other_run(one(Extend(tuple(batch)))) == [True] * len(batch), where
        assert other_run(one(Extend(tuple(strangers)))) == [False] * len(strangers), where
        assert all(lease.deadline >= was for lease, was in zip(batch, before, strict=True)), where
        assert not any(lease.lost for lease in batch), where
        assert all(s.lost for s in strangers), where  # a refused extension is a lost lease
        assert other_run(one(Extend(()))) == [], where
        for lease in batch:
            assert other_run(one(Release(lease))) is True, where


def test_a_batch_naming_one_key_twice_extends_only_the_owners_lease(stores: StorePair) -> None:
    """A keeper may hold a lease it lost and the key's new lease side by side: the stale one
    must come back refused, not ride on the new owner's row."""
    for name, run in stores.drivers:
        lease = _grant(run, _key("twice"))
        stale = _stranger(lease)
        assert run(one(Extend((stale, lease)))) == [False, True], f"{stores.name}: {name}"
        assert stale.lost and not lease.lost, f"{stores.name}: {name}"
        assert run(one(Release(lease))) is True


def test_fences_strictly_increase_across_sync_and_async_grants(stores: StorePair) -> None:
    key = _key("fences")
    fences = []
    for _ in range(3):
        for name, run in stores.drivers:
            lease = _grant(run, key)
            fences.append((name, lease.fence))
            assert run(one(Release(lease))) is True
    assert all(a[1] < b[1] for a, b in itertools.pairwise(fences)), f"{stores.name}: {fences}"


def test_a_sync_holder_excludes_an_async_one_and_vice_versa(stores: StorePair) -> None:
    for (holder, run), (other, other_run) in [stores.drivers, stores.drivers[::-1]]:
        key = _key("exclusion")
        lease = _grant(run, key)
        with pytest.raises(AcquireTimeout):
            other_run(acquire_flow(key, ttl=TTL, timeout=0.0, blocking=False))
        with pytest.raises(AcquireTimeout):  # a waiter gives up at its deadline, not before
            other_run(acquire_flow(key, ttl=TTL, timeout=0.2))
        info = run(one(Inspect(key)))
        assert isinstance(info, LockInfo) and info.fence == lease.fence, f"{holder}/{other}"
        assert run(one(Release(lease))) is True


class Watched:
    """A store that sets `waiting` when a flow first waits for a release, so the test frees
    the key only once the waiter is waiting (never by timing luck)."""

    def __init__(self, sync: Store, aio: AsyncStore) -> None:
        self.sync, self.aio = sync, aio
        self.waiting = threading.Event()

    def execute(self, op: StoreOp) -> Any:
        if isinstance(op, WaitRelease):
            self.waiting.set()
        return self.sync.execute(op)

    async def execute_async(self, op: StoreOp) -> Any:
        if isinstance(op, WaitRelease):
            self.waiting.set()
        return await self.aio.execute_async(op)


def _wait_and_release(stores: StorePair, waiter: str) -> tuple[Any, Any, Lease]:
    """Hold a key on the other kind of store, wait for it on `waiter`'s, release it once
    the waiter waits: (the release's reply, what the waiter got, the released lease)."""
    key = _key("wake")
    watched = Watched(stores.sync, stores.aio)
    holder_run = stores.run_async if waiter == "sync" else stores.run_sync
    lease = _grant(holder_run, key)
    # The waiter's deadline is under the holder's TTL: only the release can let it in.
    flow = acquire_flow(key, ttl=TTL, timeout=TTL / 2)
    got: dict[str, Any] = {}

    def release() -> None:
        assert watched.waiting.wait(TTL / 2), "the waiter never waited"
        got["released"] = holder_run(one(Release(lease)))

    def wait_in_a_thread() -> None:
        got["won"] = run_sync(flow, watched, stores.clock)

    if waiter == "sync":
        thread = threading.Thread(target=wait_in_a_thread)
        thread.start()
        release()
    else:
        thread = threading.Thread(target=release)
        thread.start()
        got["won"] = stores.runner.run(run_async(flow, watched, stores.clock))
    thread.join(TTL)
    assert not thread.is_alive()
    return got.get("released"), got.get("won"), lease


def test_a_release_wakes_a_waiter_of_the_other_kind(stores: StorePair) -> None:
    for waiter in ("sync", "async"):
        released, won, lease = _wait_and_release(stores, waiter)
        assert released is True, f"{stores.name}: {waiter} waiter"
        assert isinstance(won, Lease) and won.fence > lease.fence, f"{stores.name}: {waiter}"
        assert stores.run_sync(one(Release(won))) is True


def test_wait_release_and_the_driver_ops_return(stores: StorePair) -> None:
    for name, run in stores.drivers:
        started = time.monotonic()
        assert run(one(WaitRelease(_key("free"), 0.05))) is None, name
        assert run(one(Sleep(0.01))) is None, name
        now = run(one(Now()))
        assert isinstance(now, float) and now >= stores.clock.monotonic() - 60, name
        assert time.monotonic() - started < 20, name  # returns, bounded by its timeout


def test_slots_are_shared_by_sync_and_async_holders(stores: StorePair) -> None:
    if not stores.sync.capabilities.semaphore:
        pytest.skip(f"{stores.name} keeps no semaphores")
    for (first, run), (second, other_run) in [stores.drivers, stores.drivers[::-1]]:
        where = f"{stores.name}: {first} then {second}"
        key = _key("slots")
        a = run(one(TakeSlot(key, 2, TTL, new_owner_token())))
        b = other_run(one(TakeSlot(key, 2, TTL, new_owner_token())))
        assert isinstance(a, SlotLease) and isinstance(b, SlotLease), where
        assert a.fence < b.fence and a.limit == b.limit == 2, where
        for full in (run, other_run):
            refused = full(one(TakeSlot(key, 2, TTL, new_owner_token())))
            assert isinstance(refused, SlotWait) and 0 < refused.ttl_left <= TTL, where
        # A queued waiter is first in line, and leaving the queue gives up its place.
        waiter = new_owner_token()
        queued = other_run(one(TakeSlot(key, 2, TTL, waiter, queue_ttl=TTL)))
        assert isinstance(queued, SlotWait) and queued.position == 0, where
        assert run(one(LeaveSlot(key, waiter))) is False, where  # it held no slot
        later = new_owner_token()
        behind = other_run(one(TakeSlot(key, 2, TTL, later, queue_ttl=TTL)))
        assert isinstance(behind, SlotWait) and behind.position == 0, where
        assert run(one(LeaveSlot(key, later))) is False, where
        assert other_run(one(Release(_stranger(a)))) is False, where
        assert other_run(one(Release(a))) is True, where
        c = run(one(TakeSlot(key, 2, TTL, new_owner_token())))
        assert isinstance(c, SlotLease) and c.fence > b.fence, where
        for held in (b, c):
            assert run(one(Release(held))) is True, where


def test_rate_limits_are_shared_by_sync_and_async_callers(stores: StorePair) -> None:
    if not stores.sync.capabilities.rate_limit:
        pytest.skip(f"{stores.name} keeps no rate limits")
    for (first, run), (second, other_run) in [stores.drivers, stores.drivers[::-1]]:
        where = f"{stores.name}: {first} then {second}"
        key = _key("rate")
        took = run(one(TakeRate(key, 60.0, 1, 0.0)))
        assert isinstance(took, RateGrant) and took.admitted and took.wait == 0, where
        refused = other_run(one(TakeRate(key, 60.0, 1, 0.0)))
        assert not refused.admitted and 50 < refused.wait <= 60, where
        booked = other_run(one(TakeRate(key, 60.0, 1, 120.0)))  # a turn within max_wait
        assert booked.admitted and 50 < booked.wait <= 60, where


def test_inspect_shows_the_holder_to_both_kinds(stores: StorePair) -> None:
    for holder, run, other, other_run in _pairs(stores):
        where = f"{stores.name}: {holder} holder, {other} inspects"
        key = _key("inspect")
        assert other_run(one(Inspect(key))) is None, where
        lease = _grant(run, key)
        info = other_run(one(Inspect(key)))
        assert isinstance(info, LockInfo), where
        assert info.key == key and info.fence == lease.fence and 0 < info.ttl_left <= TTL, where
        assert lease.owner not in repr(info), where  # never the owner token
        assert run(one(Release(lease))) is True, where
        assert other_run(one(Inspect(key))) is None, where


def _begin(run: Run, key: str, fingerprint: str = "fp-1", *, record: bool = True) -> Lease:
    got = run(one(Begin(key, TTL, record=record, fingerprint=fingerprint)))
    assert isinstance(got, Lease), f"{key} not begun: {got!r}"
    return got


def _commit(run: Run, lease: Lease, state: str = "DONE", result: str = '{"paid": 42}') -> bool:
    ok: bool = run(one(Commit(lease, state, result, "fp-1", TTL)))
    return ok


def test_a_job_begun_on_one_kind_is_committed_and_replayed_on_the_other(
    stores: StorePair,
) -> None:
    """begin, busy for another run, commit DONE, then the record is the answer to a begin
    and a read, whichever store asks: sync and async share one record space."""
    for holder, run, other, other_run in _pairs(stores, by_token=True):
        where = f"{stores.name}: {holder} begins, {other} commits"
        key = _key("job")
        lease = _begin(run, key)
        busy = other_run(one(Begin(key, TTL, record=True, fingerprint="fp-2")))
        assert isinstance(busy, Busy) and 0 < busy.ttl_left <= TTL, where
        assert busy.fingerprint == "fp-1", where  # the holder's, to spot a conflict
        assert other_run(one(ReadRecord(key))) is None, where  # running is no record
        assert _commit(other_run, _stranger(lease), result='"forged"') is False, where
        assert _commit(other_run, lease) is True, where
        assert lease.released, where
        assert run(one(Inspect(key))) is None, f"{where}: commit did not release"
        for name, reader in stores.drivers:
            replay = reader(one(Begin(key, TTL, record=True, fingerprint="fp-1")))
            seen = (replay.state, replay.result, replay.fingerprint, replay.fence)
            assert seen == ("DONE", '{"paid": 42}', "fp-1", lease.fence), f"{where}; {name}"
            assert reader(one(ReadRecord(key))) == replay, f"{where}; {name} reads"
        assert run(one(Inspect(key))) is None, f"{where}: a replay took the lock"


def test_a_plain_begin_after_a_record_and_a_begin_after_failed_are_fresh_grants(
    stores: StorePair,
) -> None:
    for (first, run), (second, other_run) in [stores.drivers, stores.drivers[::-1]]:
        where = f"{stores.name}: {first} then {second}"
        done_key, failed_key = _key("plain"), _key("failed")
        done = _begin(run, done_key)
        assert _commit(run, done) is True, where
        plain = _begin(other_run, done_key, "", record=False)  # a lock ignores job records
        assert plain.fence > done.fence, where
        assert other_run(one(Release(plain))) is True, where
        failed = _begin(run, failed_key)
        assert _commit(run, failed, "FAILED", '"boom"') is True, where
        record = other_run(one(ReadRecord(failed_key)))
        assert isinstance(record, JobRecord) and record.state == "FAILED", where
        retry = _begin(other_run, failed_key)  # FAILED does not stop a new run
        assert retry.fence > failed.fence, where
        assert _commit(other_run, retry) is True, where
        record = other_run(one(ReadRecord(failed_key)))
        assert isinstance(record, JobRecord), where
        assert (record.state, record.fence) == ("DONE", retry.fence), where


def test_deliveries_are_counted_by_both_kinds_on_one_count(stores: StorePair) -> None:
    key = _key("deliveries")
    runs = [run for _, run in stores.drivers]
    counts = [runs[i % 2](one(CountDelivery(key, TTL))) for i in range(4)]
    assert counts == [1, 2, 3, 4], f"{stores.name}: {counts}"


def test_the_publish_claim_is_one_claim_for_both_kinds(stores: StorePair) -> None:
    for (first, run), (second, other_run) in [stores.drivers, stores.drivers[::-1]]:
        where = f"{stores.name}: {first} then {second}"
        key = _key("claim")
        assert run(one(ClaimPublish(key, "t1", TTL))) is None, where
        assert other_run(one(ClaimPublish(key, "t1", TTL))) is None, where  # the same task
        assert other_run(one(ClaimPublish(key, "t2", TTL))) == "t1", where  # the holder
        assert other_run(one(SwapPublish(key, "t1", "t2", TTL))) is None, where  # handed over
        assert run(one(ClaimPublish(key, "t9", TTL))) == "t2", where
        assert run(one(SwapPublish(key, "t1", "t3", TTL))) == "t2", where  # t1 holds no more
        assert other_run(one(SwapPublish(key, "t1", None, TTL))) == "t2", where  # not its own
        assert other_run(one(SwapPublish(key, "t2", None, TTL))) is None, where  # cleared
        assert run(one(ClaimPublish(key, "t4", TTL))) is None, where
        assert other_run(one(ClearPublish(key))) is None, where
        assert run(one(ClaimPublish(key, "t5", TTL))) is None, f"{where}: not cleared"
        assert run(one(ClearPublish(key))) is None, where
