"""Redlock under master failures: killed, paused with replies in flight, restarted empty.

Each fault runs against jobfence's RedlockBackend and against a control: a naive majority
lock written the way the articles and redlock-py write it (SET NX PX on each master in
turn, a majority of OKs is a grant, no check of the time the acquire took, no clean-up of
a failed attempt), or pottery's NextID for fences. The control shows the harm (two holders,
a key left behind, a fence going down); jobfence under the same fault does not.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from devstack.redis_masters import RedisMasters
from jobfence.locks import BackendUnavailable, Lease, LeaseLost, RedisFenceGuard, StaleFence
from jobfence.locks.backends.redlock import RedlockBackend
from tests.servers import wait_for

pytestmark = pytest.mark.fault

PREFIX = "rlf"


@pytest.fixture
def masters() -> Iterator[RedisMasters]:
    """Three private masters for this test only: free to kill, pause and restart."""
    with RedisMasters(3) as m:
        yield m


def backend(masters: RedisMasters, socket_timeout: float = 2.0) -> RedlockBackend:
    return RedlockBackend.from_url(masters.url, prefix=PREFIX, socket_timeout=socket_timeout)


def lock_keys(masters: RedisMasters) -> list[list[str]]:
    return masters.keys(f"{PREFIX}:lock:*")


class NaiveMajorityLock:
    """The control: SET NX PX on each master in turn; a majority of OKs is a grant."""

    def __init__(
        self, masters: RedisMasters, key: str, ttl_ms: int, *, socket_timeout: float = 5.0
    ) -> None:
        self.clients = [
            redis.Redis(
                host=s.host, port=s.port, socket_timeout=socket_timeout,
                retry=Retry(NoBackoff(), 0),
            )
            for s in masters.servers
        ]
        self.key, self.ttl_ms = f"naive:{key}", ttl_ms
        self.token = secrets.token_hex(8)

    def acquire(self) -> bool:
        ok = 0
        for client in self.clients:
            with contextlib.suppress(redis.RedisError):
                ok += bool(client.set(self.key, self.token, nx=True, px=self.ttl_ms))
        return ok > len(self.clients) // 2

    def close(self) -> None:
        for client in self.clients:
            client.close()


def resume_later(masters: RedisMasters, indexes: list[int], delay: float) -> threading.Timer:
    def resume() -> None:
        for i in indexes:
            masters.servers[i].resume()

    timer = threading.Timer(delay, resume)
    timer.start()
    return timer


# --------------------------------------------------------------------------- one of three down


def test_control_a_lock_that_needs_every_master_stops_when_one_dies(masters: RedisMasters) -> None:
    masters.servers[2].kill()
    every = NaiveMajorityLock(masters, "every", 10_000)
    try:
        answers = []
        for client in every.clients:
            try:
                answers.append(client.set(every.key, every.token, nx=True, px=10_000))
            except redis.RedisError as exc:
                answers.append(exc)
        # redlock-py's rule: any error fails the attempt, a majority of OKs notwithstanding.
        assert isinstance(answers[2], redis.ConnectionError) and answers[:2] == [True, True]
    finally:
        every.close()


def test_one_of_three_masters_killed_grants_continue_and_fences_rise(
    masters: RedisMasters,
) -> None:
    b = backend(masters)
    try:
        before = b.try_acquire("k", 5.0)
        assert before is not None and before.release()
        masters.servers[2].kill()
        fences = [before.fence]
        for _ in range(20):
            lease = b.try_acquire("k", 5.0)
            assert lease is not None, "a majority is up: the grant must go through"
            fences.append(lease.fence)
            assert lease.extend() is None and lease.release()
        masters.servers[2].start()  # back, empty: it takes part again
        wait_for(lambda: _all_three_lock(b), timeout=5.0, message="the master never came back")
        lease = b.try_acquire("k", 5.0)
        assert lease is not None and lease.fence > fences[-1]
        assert lease.release()
        assert all(a < b for a, b in itertools.pairwise(fences))
    finally:
        b.close()
    assert lock_keys(masters) == [[], [], []]


def _all_three_lock(b: RedlockBackend) -> bool:
    lease = b.try_acquire("probe", 5.0)
    held = lease is not None and sum(
        1 for m in b.masters if m.client.hget(f"{PREFIX}:lock:{{probe}}", "fence")
    ) == 3
    if lease is not None:
        lease.release()
    return held


# --------------------------------------------------------------------------- two of three down


def test_control_a_failed_naive_attempt_leaves_its_key_on_the_survivor(
    masters: RedisMasters,
) -> None:
    masters.servers[1].kill()
    masters.servers[2].kill()
    naive = NaiveMajorityLock(masters, "survivor", 30_000)
    try:
        assert naive.acquire() is False
        assert naive.clients[0].get(naive.key) is not None, "the control left nothing"
    finally:
        naive.close()


def test_two_of_three_masters_killed_a_clear_error_and_nothing_held(
    masters: RedisMasters,
) -> None:
    b = backend(masters)
    try:
        masters.servers[1].kill()
        masters.servers[2].kill()
        with pytest.raises(BackendUnavailable) as failed:
            b.try_acquire("k", 30.0)
        assert "1 of 3 masters answered, a majority of 2 is needed" in str(failed.value)
        assert lock_keys(masters)[0] == [], "the failed attempt left its key on the survivor"
        with pytest.raises(BackendUnavailable):
            b.begin("job", 30.0, record=True, fingerprint="fp")
        assert lock_keys(masters)[0] == []
    finally:
        b.close()


# --------------------------------------------------------------------------- paused masters


def test_control_naive_majority_lock_grants_after_its_validity_and_overlaps(
    masters: RedisMasters,
) -> None:
    """Master 2 frozen while the naive lock's SET is in flight: by the time its reply
    comes, the naive lock's keys on masters 0 and 1 have expired and a second naive client
    took them (giving up on the frozen master after 0.1 s), yet the first counts three OKs
    and goes ahead: two holders."""
    first = NaiveMajorityLock(masters, "overlap", 300)
    second = NaiveMajorityLock(masters, "overlap", 10_000, socket_timeout=0.1)
    got: list[bool] = []
    masters.servers[2].pause()
    try:
        thread = threading.Thread(target=lambda: got.append(first.acquire()))
        thread.start()
        wait_for(lambda: first.clients[0].get(first.key) == first.token.encode(), timeout=5.0)
        wait_for(lambda: all(c.get(first.key) is None for c in first.clients[:2]),
                 timeout=5.0, message="the first holder's keys never expired")  # fmt: skip
        assert second.acquire(), "the second client should get masters 0 and 1"
        masters.servers[2].resume()
        thread.join(10)
        assert got == [True], "two holders: the first lock counted its late majority"
    finally:
        if masters.servers[2].paused:
            masters.servers[2].resume()
        first.close()
        second.close()


def test_a_grant_whose_majority_replies_come_after_its_ttl_is_never_used(
    masters: RedisMasters,
) -> None:
    """Two masters frozen past the TTL while the acquire's replies are in flight."""
    ttl = 0.3
    b, other = backend(masters), backend(masters)
    masters.servers[1].pause()
    masters.servers[2].pause()
    timer = resume_later(masters, [1, 2], 0.6)
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            b.try_acquire("k", ttl)
        assert time.monotonic() - started < 0.6, "it waited for replies past the validity"
        timer.join(5)
        # The late phase one ran on masters 1 and 2 after the resume, and the release sent
        # behind it on the same connection removed it again: nothing is left anywhere.
        wait_for(lambda: lock_keys(masters) == [[], [], []], timeout=2.0,
                 message=lambda: f"left behind: {lock_keys(masters)}")  # fmt: skip
        lease = other.try_acquire("k", 5.0)
        assert lease is not None and lease.release()
    finally:
        timer.cancel()
        for server in masters.servers:
            if server.paused:
                server.resume()
        b.close()
        other.close()


def test_one_master_frozen_during_a_grant_the_lease_lapses_before_another_can_take_it(
    masters: RedisMasters,
) -> None:
    """The same fault as the control: the lease counts its TTL from before the request went
    out, so it is over before its keys on the live masters expire and another client can
    take them."""
    ttl = 0.3
    first, second = backend(masters), backend(masters, socket_timeout=0.5)
    masters.servers[2].pause()
    try:
        sent = first.clock.monotonic()
        lease = first.try_acquire("k", ttl)
        got = first.clock.monotonic()
        # Its validity counts from when the request went out, not from the reply, which waited
        # for the frozen master's timeout (a loaded machine may have spent all of the
        # validity already: how much is left is no part of the claim).
        assert lease is not None and lease.deadline - ttl <= sent + (got - sent) / 2
        # Until the first lease's keys expire on both live masters, the second client sees
        # them busy, or one busy and one free with the frozen master silent: no majority
        # either way (the latter is reported as unavailable, not as a live holder).
        taken = wait_for(lambda: _acquire(second, ttl=10.0), timeout=5.0)
        assert not lease.held, "two holders: the first lease outlived its keys"
        with pytest.raises(LeaseLost):
            lease.check()
        assert taken.fence > lease.fence
        # And a frozen first holder that writes anyway is refused by the resource's guard.
        store = masters.client(0)
        guard = RedisFenceGuard(store, prefix="res")
        guard.write("account", taken.fence, [("RPUSH", "writes", "new")], write_id="new")
        with pytest.raises(StaleFence):
            guard.write("account", lease.fence, [("RPUSH", "writes", "old")], write_id="old")
        assert store.lrange("writes", 0, -1) == ["new"]
        store.close()
        masters.servers[2].resume()
        assert taken.release()
        assert lease.release() is False
    finally:
        if masters.servers[2].paused:
            masters.servers[2].resume()
        first.close()
        second.close()
    # The second client's request to the frozen master may time out (0.5 s) on a loaded
    # machine: its connection is gone, and the master runs the buffered SET when it wakes,
    # perhaps after the release sent on a new connection. That key lapses by its own TTL
    # (10 s); nothing outlives it.
    wait_for(lambda: lock_keys(masters) == [[], [], []], timeout=12.0,
             message=lambda: f"left behind: {lock_keys(masters)}")  # fmt: skip


def test_a_slow_acquire_gets_only_the_validity_that_is_left(masters: RedisMasters) -> None:
    """Two masters frozen for part of the TTL: the grant comes once they answer, and the
    lease has the TTL minus the time that took, not the whole TTL."""
    ttl, frozen = 1.0, 0.3
    b, other = backend(masters), backend(masters)
    masters.servers[1].pause()
    masters.servers[2].pause()
    resumed_at: list[float] = []

    def resume() -> None:
        resumed_at.append(time.monotonic())  # before the masters answer again
        for i in (1, 2):
            masters.servers[i].resume()

    timer = threading.Timer(frozen, resume)
    try:
        timer.start()
        started = time.monotonic()
        lease = b.try_acquire("k", ttl)
        assert lease is not None, "the majority answered within the TTL"
        # The grant cannot come before the masters woke; the time it waited for them is
        # taken from the lease (the timer started first, so the wait is nearly `frozen`).
        waited = resumed_at[0] - started
        assert waited >= frozen / 2, "the acquire did not wait for the frozen masters"
        assert lease.remaining() <= ttl - waited
        # Its keys were set when the masters woke, so they outlive the lease: nobody else
        # gets in while it is held.
        taken = wait_for(lambda: _acquire(other), timeout=5.0)
        assert not lease.held
        assert taken.fence > lease.fence and taken.release()
    finally:
        timer.cancel()
        for server in masters.servers:
            if server.paused:
                server.resume()
        b.close()
        other.close()


# --------------------------------------------------------------------------- lost data


def test_control_pottery_next_id_goes_back_to_1_when_the_masters_lose_their_data(
    masters: RedisMasters,
) -> None:
    from pottery import NextID

    clients = [m.client() for m in masters.servers]
    ids = NextID(key="fence", masters=set(clients))
    before = [next(ids) for _ in range(5)]
    masters.lose_all_data()
    ids = NextID(key="fence", masters={m.client() for m in masters.servers})
    after = next(ids)
    assert after <= before[-1], "the control's counter kept increasing: it proves nothing"


def test_masters_restarted_without_their_data_fences_still_increase(
    masters: RedisMasters,
) -> None:
    b = backend(masters)
    fences: list[int] = []
    try:
        for restart in (0, 1, 2, None):
            for _ in range(5):
                lease = wait_for(lambda: _acquire(b), timeout=5.0, message="no grant")
                fences.append(lease.fence)
                assert lease.release()
            if restart is not None:
                masters.restart(restart)  # one master at a time comes back empty
        held = b.try_acquire("k", 30.0)
        assert held is not None
        fences.append(held.fence)
        masters.lose_all_data()  # all of them at once: only the clocks remain
        fresh = backend(masters)  # a client with no floor of its own either
        try:
            lease = wait_for(lambda: _acquire(fresh), timeout=5.0, message="no grant")
            fences.append(lease.fence)
            assert lease.release()
        finally:
            fresh.close()
    finally:
        b.close()
    assert all(a < c for a, c in itertools.pairwise(fences)), fences


def _acquire(b: RedlockBackend, ttl: float = 5.0) -> Lease | None:
    try:
        return b.try_acquire("k", ttl)
    except BackendUnavailable:  # a master restarted or frozen: no majority this time
        return None


# --------------------------------------------------------------------------- extensions


def test_extend_many_keeps_a_lease_while_a_majority_still_holds_it(masters: RedisMasters) -> None:
    b = backend(masters)
    try:
        kept, dropped = b.try_acquire("kept", 5.0), b.try_acquire("dropped", 5.0)
        assert kept is not None and dropped is not None
        masters.servers[2].kill()
        rounds = b.rounds
        assert b.extend_many([kept, dropped]) == [True, True]  # two of three still hold both
        # Master 0 loses the second lease's key: only master 1 still holds it, no majority.
        masters.client(0).delete(f"{PREFIX}:lock:{{dropped}}")
        assert b.extend_many([kept, dropped]) == [True, False]
        assert b.rounds - rounds == 2, "one parallel round trip per extend_many"
        assert kept.held and dropped.lost
        assert kept.release()
    finally:
        b.close()
