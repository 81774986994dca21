"""The lock flows fed scripted replies, with no server: every branch of acquire, slot and rate."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from jobfence.locks import (
    AcquireTimeout,
    BackendUnavailable,
    Busy,
    Lease,
    LockError,
    ManualClock,
    MemoryBackend,
    RateLimited,
)
from jobfence.locks.backend import RateGrant
from jobfence.locks.drive import run_async, run_sync
from jobfence.locks.flows import Backoff, acquire_flow, campaign_flow, rate_flow, slot_flow
from jobfence.locks.lease import OwnerMeta
from jobfence.locks.ops import (
    Acquire,
    LeaveSlot,
    Now,
    ReleaseOwner,
    Sleep,
    StoreOp,
    TakeRate,
    TakeSlot,
    WaitRelease,
)
from jobfence.locks.ratelimit import Rate
from jobfence.locks.slots import SlotLease, SlotWait

BACKEND = MemoryBackend()
CLOCK = ManualClock()


def _lease(key: str = "k", fence: int = 7) -> Lease:
    return Lease(key=key, owner="o", fence=fence, ttl=10.0, deadline=1e9, backend=BACKEND,
                 clock=CLOCK)  # fmt: skip


def _slot(key: str = "s", fence: int = 3) -> SlotLease:
    return SlotLease(key=key, owner="o", fence=fence, ttl=10.0, deadline=1e9, backend=BACKEND,
                     clock=CLOCK, limit=2)  # fmt: skip


def _backoff() -> Backoff:
    return Backoff(rng=random.Random(1))


def test_acquire_free_is_one_round_trip() -> None:
    flow = acquire_flow("k", ttl=10, timeout=5, backoff=_backoff())
    assert flow.send(None) == Now()
    op = flow.send(100.0)
    assert isinstance(op, Acquire) and (op.key, op.ttl) == ("k", 10)
    lease = _lease()
    with pytest.raises(StopIteration) as stop:
        flow.send(lease)
    assert stop.value.value is lease


def test_acquire_busy_waits_for_the_release_then_takes_it() -> None:
    flow = acquire_flow("k", ttl=10, timeout=5, backoff=_backoff())
    flow.send(None)
    first = flow.send(100.0)
    assert isinstance(first, Acquire)
    assert flow.send(Busy(ttl_left=0.0005)) == Now()
    wait = flow.send(100.1)
    # Bounded by the holder's TTL left: an expiry is noticed at once.
    assert isinstance(wait, WaitRelease) and wait.key == "k" and 0 < wait.timeout <= 0.0015
    again = flow.send(None)  # woken: the release signal, or the wait ran out
    assert isinstance(again, Acquire) and again.owner == first.owner  # one owner per acquire
    with pytest.raises(StopIteration):
        flow.send(_lease())


def test_acquire_wait_is_bounded_by_the_deadline() -> None:
    flow = acquire_flow("k", ttl=10, timeout=0.002, backoff=Backoff(base=0.5, cap=0.5))
    flow.send(None)
    flow.send(100.0)
    flow.send(Busy(ttl_left=60))
    wait = flow.send(100.001)
    assert isinstance(wait, WaitRelease) and wait.timeout <= 0.001 + 1e-9


def test_acquire_times_out_at_the_deadline() -> None:
    flow = acquire_flow("k", ttl=10, timeout=5, backoff=_backoff())
    flow.send(None)
    flow.send(100.0)
    flow.send(Busy(ttl_left=60))
    with pytest.raises(AcquireTimeout, match="within 5s"):
        flow.send(105.0)


def test_acquire_non_blocking_busy_raises_at_once() -> None:
    flow = acquire_flow("k", ttl=10, timeout=0, blocking=False)
    flow.send(None)
    flow.send(100.0)
    with pytest.raises(AcquireTimeout, match="held by another owner"):
        flow.send(Busy(ttl_left=3))


def test_acquire_cancelled_between_attempts() -> None:
    flow = acquire_flow("k", ttl=10, timeout=5, cancelled=lambda: True)
    flow.send(None)
    flow.send(100.0)
    with pytest.raises(AcquireTimeout, match="cancelled"):
        flow.send(Busy(ttl_left=3))


def test_acquire_backend_down_raises_and_sends_nothing_more() -> None:
    flow = acquire_flow("k", ttl=10, timeout=5)
    flow.send(None)
    flow.send(100.0)
    with pytest.raises(BackendUnavailable):
        flow.throw(BackendUnavailable("down", key="k"))


def test_acquire_lost_reply_on_cancel_releases_by_owner() -> None:
    """Cancelled while the request was out: the grant may exist; it is released by token."""
    flow = acquire_flow("k", ttl=10, timeout=5)
    flow.send(None)
    sent = flow.send(100.0)
    assert isinstance(sent, Acquire)
    cleanup = flow.throw(asyncio.CancelledError())
    assert cleanup == ReleaseOwner("k", sent.owner)
    with pytest.raises(asyncio.CancelledError):
        flow.send(True)


def test_acquire_cancel_cleanup_that_fails_still_cancels() -> None:
    flow = acquire_flow("k", ttl=10, timeout=5)
    flow.send(None)
    flow.send(100.0)
    flow.throw(asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        flow.throw(BackendUnavailable("down"))


def test_acquire_cancelled_while_waiting_sends_nothing() -> None:
    flow = acquire_flow("k", ttl=10, timeout=5)
    flow.send(None)
    flow.send(100.0)
    flow.send(Busy(ttl_left=3))
    assert isinstance(flow.send(100.0), WaitRelease)
    with pytest.raises(asyncio.CancelledError):
        flow.throw(asyncio.CancelledError())


def test_acquire_refuses_a_bad_timeout_before_any_op() -> None:
    with pytest.raises(LockError, match="timeout"):
        acquire_flow("k", ttl=10, timeout=float("nan")).send(None)


def test_slot_waits_in_the_queue_then_takes_a_slot() -> None:
    flow = slot_flow("s", limit=2, ttl=10, timeout=5, backoff=_backoff())
    flow.send(None)
    take = flow.send(100.0)
    assert isinstance(take, TakeSlot) and take.queue_ttl > 0 and take.limit == 2
    assert flow.send(SlotWait(position=0, ttl_left=9)) == Now()
    pause = flow.send(100.0)
    assert isinstance(pause, Sleep) and 0 < pause.seconds <= 0.02  # next in line: polls fast
    again = flow.send(None)
    assert isinstance(again, TakeSlot) and again.owner == take.owner  # keeps its place
    slot = _slot()
    with pytest.raises(StopIteration) as stop:
        flow.send(slot)
    assert stop.value.value is slot


def test_slot_timeout_leaves_the_queue() -> None:
    flow = slot_flow("s", limit=1, ttl=10, timeout=1)
    flow.send(None)
    take = flow.send(100.0)
    flow.send(SlotWait(position=3, ttl_left=9))
    leave = flow.send(101.0)
    assert leave == LeaveSlot("s", take.owner)
    with pytest.raises(AcquireTimeout, match="3 waiting ahead"):
        flow.send(True)


def test_slot_error_leaves_the_queue_and_a_failed_leave_is_not_the_error() -> None:
    flow = slot_flow("s", limit=1, ttl=10, timeout=1)
    flow.send(None)
    flow.send(100.0)
    assert isinstance(flow.throw(asyncio.CancelledError()), LeaveSlot)
    with pytest.raises(asyncio.CancelledError):
        flow.throw(BackendUnavailable("down"))


def test_slot_try_takes_no_place_in_the_queue() -> None:
    flow = slot_flow("s", limit=1, ttl=10, timeout=0)
    flow.send(None)
    take = flow.send(100.0)
    assert isinstance(take, TakeSlot) and take.queue_ttl == 0
    flow.send(SlotWait(position=-1, ttl_left=9))
    with pytest.raises(AcquireTimeout):
        flow.send(100.0)  # nothing queued: nothing to leave


def test_slot_try_cancelled_mid_request_leaves_the_slot_it_may_hold() -> None:
    """timeout=0 takes no ticket, but a cancel landing on its TakeSlot may follow a grant
    (the reply never read): the slot is given up now, not held until its TTL."""
    flow = slot_flow("s", limit=1, ttl=10, timeout=0)
    flow.send(None)
    take = flow.send(100.0)
    assert isinstance(take, TakeSlot) and take.queue_ttl == 0
    assert flow.throw(asyncio.CancelledError()) == LeaveSlot("s", take.owner)
    with pytest.raises(asyncio.CancelledError):
        flow.send(True)


def test_rate_admitted_sleeps_out_its_turn() -> None:
    flow = rate_flow("api", Rate(100, 60), timeout=None)
    take = flow.send(None)
    assert isinstance(take, TakeRate) and take.interval == pytest.approx(0.6)
    assert take.max_wait == float("inf")
    assert flow.send(RateGrant(True, 0.25, 1.0)) == Sleep(0.25)
    with pytest.raises(StopIteration):
        flow.send(None)


def test_rate_refused_raises_with_retry_after() -> None:
    flow = rate_flow("api", Rate(1, 60), timeout=1)
    flow.send(None)
    with pytest.raises(RateLimited) as err:
        flow.send(RateGrant(False, 30.0, 1.0))
    assert err.value.retry_after == 30.0


class _Scripted:
    """A store that answers each op from a list, sync and async, and records what it got."""

    def __init__(self, replies: list[Any]) -> None:
        self.replies = replies
        self.ops: list[StoreOp] = []

    def execute(self, op: StoreOp) -> Any:
        self.ops.append(op)
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def execute_async(self, op: StoreOp) -> Any:
        await asyncio.sleep(0)
        return self.execute(op)


def test_run_sync_sleeps_on_the_clock_and_returns_the_value() -> None:
    clock = ManualClock(0.0)
    store = _Scripted([Busy(ttl_left=60), None, _lease(fence=9)])
    lease = run_sync(acquire_flow("k", ttl=10, timeout=5, backoff=_backoff()), store, clock)
    assert lease.fence == 9
    assert [type(op) for op in store.ops] == [Acquire, WaitRelease, Acquire]
    rate = run_sync(rate_flow("r", Rate(1, 1), timeout=5), _Scripted([RateGrant(True, 2, 0)]),
                    clock)  # fmt: skip
    assert rate.wait == 2 and clock.now == 2.0  # the Sleep went to the clock


def test_run_sync_throws_a_store_failure_into_the_flow() -> None:
    store = _Scripted([SlotWait(0, 1), BackendUnavailable("down"), True])
    with pytest.raises(BackendUnavailable):
        run_sync(slot_flow("s", limit=1, ttl=10, timeout=5), store, ManualClock(0.0))
    assert [type(op) for op in store.ops] == [TakeSlot, TakeSlot, LeaveSlot]


def test_run_async_cancel_during_a_round_trip_releases_the_grant() -> None:
    class Hanging(_Scripted):
        async def execute_async(self, op: StoreOp) -> Any:
            self.ops.append(op)
            if isinstance(op, Acquire):
                await asyncio.sleep(3600)
            return True

    async def main() -> list[StoreOp]:
        store = Hanging([])
        flow = acquire_flow("k", ttl=10, timeout=5)
        task = asyncio.ensure_future(run_async(flow, store, ManualClock(0.0)))
        while not store.ops:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return store.ops

    ops = asyncio.run(main())
    assert isinstance(ops[0], Acquire) and ops[1] == ReleaseOwner("k", ops[0].owner)


def test_campaign_waits_for_ever_by_default_and_tags_the_leader() -> None:
    meta = OwnerMeta(host="h", pid=1, task_name="jobfence.leader")
    flow = campaign_flow("leader:x", ttl=5, meta=meta, backoff=_backoff())
    flow.send(None)
    take = flow.send(100.0)
    assert isinstance(take, Acquire) and take.meta == meta
    flow.send(Busy(ttl_left=5))
    wait = flow.send(1e9)  # a billion seconds later: still waiting, no timeout
    assert isinstance(wait, WaitRelease)
    assert isinstance(flow.send(None), Acquire)


def test_run_async_cancel_in_a_slot_queue_leaves_it() -> None:
    class Queued(_Scripted):
        async def execute_async(self, op: StoreOp) -> Any:
            self.ops.append(op)
            return SlotWait(position=1, ttl_left=9) if isinstance(op, TakeSlot) else True

    async def main() -> list[StoreOp]:
        store = Queued([])
        flow = slot_flow("s", limit=1, ttl=10, timeout=60, backoff=_backoff())
        task = asyncio.ensure_future(run_async(flow, store, ManualClock(0.0)))
        while len(store.ops) < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return store.ops

    ops = asyncio.run(main())
    assert isinstance(ops[-1], LeaveSlot) and ops[-1].owner == ops[0].owner  # type: ignore[union-attr]
