"""Leader election on every backend: one leader at a time, hand-over on resignation and on
death, a term's end told through its event, callback and check(), re-campaigning electors."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from prometheus_client import CollectorRegistry

from jobfence.locks import (
    AcquireTimeout,
    LeaseKeeper,
    LeaseLost,
    LockBackend,
    Locker,
    ManualClock,
    MemoryBackend,
    NotOwner,
    Term,
    open_backend,
)
from jobfence.locks.leader import leader_key
from jobfence.tasks.metrics import Metrics
from tests.contract.conftest import BackendHarness, _harness
from tests.servers import wait_for

#: The backends the election runs on here (each is a lease with a fence, so every backend
#: in conftest.BACKENDS qualifies; these are the cheap ones to start).
LEADER_BACKENDS = [
    "redis", "memory", "postgres", "mariadb", "redlock3", "sentinel", "cluster", "etcd",
    "zookeeper", "valkey",
]  # fmt: skip
#: 2 s: with 1 s, a leader's keeper starved past its lease on a loaded machine (four test
#: workers beside long runs) and the standby was elected under a live leader's nose.
TTL = 2.0
#: A standby notices an expiry within one backoff step (cap 0.5 s, jittered) at worst, and
#: this box is shared: the margin over one TTL.
MARGIN = 0.6


@pytest.fixture(params=LEADER_BACKENDS)
def harness(request: pytest.FixtureRequest) -> Iterator[BackendHarness]:
    h = _sql_harness(request) if request.param in SQL else _harness(request.param, request)
    yield h
    h.close()


SQL = {"postgres": "pg_url", "mariadb": "mariadb_url"}


def _sql_harness(request: pytest.FixtureRequest) -> BackendHarness:
    """The session's scratch database (a database per test, as the lock contract makes, costs
    a second or two here; every election has a name of its own)."""
    url: str = request.getfixturevalue(SQL[request.param])
    url = url.replace("mysql+pymysql://", "mariadb://", 1)

    def connect() -> LockBackend:
        return open_backend(url, prefix="leader")

    return BackendHarness(name=request.param, backend=connect(), connect=connect)


@pytest.fixture
def lockers(harness: BackendHarness) -> Iterator[tuple[Locker, Locker]]:
    """Two contenders, each with a client and a keeper of its own (one can die alone)."""
    a = Locker(harness.backend, keeper=LeaseKeeper(), ttl=TTL)
    b = Locker(harness.another_client(), keeper=LeaseKeeper(), ttl=TTL)
    yield a, b
    a.keeper.stop()
    b.keeper.stop()


def _name() -> str:
    return f"reports-{uuid.uuid4().hex[:8]}"


def test_one_process_leads_and_a_resignation_hands_over_at_once(lockers):
    a, b = lockers
    name = _name()
    elected: list[tuple[Term, float]] = []
    release_b = threading.Event()

    def standby() -> None:
        with b.leader(name, timeout=10 * TTL) as term:
            elected.append((term, time.monotonic()))
            release_b.wait(10)

    with ExitStack() as stack:
        ta = stack.enter_context(a.leader(name))
        assert ta.leading and ta.lease.key == leader_key(name)
        with pytest.raises(AcquireTimeout), b.leader(name, blocking=False):
            pass
        thread = threading.Thread(target=standby)
        thread.start()
        time.sleep(TTL / 10)  # the standby is waiting (nothing to poll for: it must not lead)
        assert not elected
    resigned = time.monotonic()  # the with block ended: the term was resigned
    wait_for(lambda: elected, timeout=3 * TTL, message="the standby was never elected")
    release_b.set()
    thread.join(5)
    tb, at = elected[0]
    assert at - resigned < TTL / 2  # at once, not after the TTL
    assert tb.fence > ta.fence
    assert ta.lost.is_set() and ta.cause is None  # resigned, not lost
    with pytest.raises(LeaseLost, match="resigned"):
        ta.check()


def test_a_standby_takes_over_within_one_ttl_after_the_leader_dies(lockers):
    a, b = lockers
    name = _name()
    with ExitStack() as stack:
        ta = stack.enter_context(a.leader(name))
        a.keeper.stop()  # the leader dies: no more heartbeats, no release
        died = time.monotonic()
        tb = stack.enter_context(b.leader(name, timeout=3 * ta.lease.ttl))
        took = time.monotonic() - died
        assert took <= ta.lease.ttl + MARGIN, took  # the TTL granted (etcd: whole seconds)
        assert tb.fence > ta.fence and tb.leading
        # The dead leader's term reads as lost by its own deadline, keeper or not.
        assert ta.lost.is_set() and not ta.leading
        with pytest.raises(LeaseLost, match="leadership lost"):
            ta.check()


def test_a_leader_whose_lease_is_taken_is_told_by_event_callback_and_check(lockers, harness):
    a, b = lockers
    name = _name()
    told: list[Term] = []
    with ExitStack() as stack:
        with ExitStack() as leading:
            ta = leading.enter_context(a.leader(name, on_lost=told.append))
            assert harness.another_client().force_release(leader_key(name))  # an operator
            tb = stack.enter_context(b.leader(name, blocking=False))
            # The next heartbeat (a third of the TTL) is refused: the term ends.
            assert ta.lost.wait(ta.lease.ttl), "the leader never learnt it lost the lease"
            wait_for(lambda: told, timeout=TTL, message="on_lost was never called")
            assert told == [ta] and isinstance(ta.cause, LeaseLost)
            with pytest.raises(LeaseLost, match="leadership lost"):
                ta.check()
        # Leaving the block resigned the lost term, without touching the successor's grant.
        info = harness.backend.inspect(leader_key(name))
        assert info is not None and info.fence == tb.fence > ta.fence and tb.leading


def test_an_elector_campaigns_again_after_a_lost_term(lockers, harness):
    a, _ = lockers
    name = _name()
    elected: list[Term] = []
    lost: list[Term] = []
    elector = a.campaign(name, on_elected=elected.append, on_lost=lost.append)
    try:
        first = elector.wait_elected(timeout=3 * TTL)
        assert first is not None and elector.is_leader
        harness.another_client().force_release(leader_key(name))
        wait_for(lambda: len(elected) == 2, timeout=3 * first.lease.ttl, message="never re-elected")
        assert lost == [first] and isinstance(first.cause, NotOwner)
        second = elected[1]
        assert second.fence > first.fence and elector.term is second
    finally:
        elector.stop()
    assert not elector.is_leader and not second.leading and second.cause is None
    assert harness.backend.inspect(leader_key(name)) is None  # resigned: the key is free


def test_stopping_a_leading_elector_hands_over_to_a_standby_elector_at_once(lockers):
    a, b = lockers
    name = _name()
    first = a.campaign(name)
    ta = first.wait_elected(timeout=3 * TTL)
    second = b.campaign(name)
    try:
        assert ta is not None
        assert second.wait_elected(timeout=TTL / 10) is None  # standing by
        stopped = time.monotonic()
        first.stop()
        tb = second.wait_elected(timeout=3 * TTL)
        took = time.monotonic() - stopped
        assert tb is not None and tb.fence > ta.fence
        assert took < TTL / 2, took
    finally:
        first.stop()
        second.stop()


# --------------------------------------------------------------------------- pure logic


def test_a_frozen_leader_reads_its_term_as_lost_on_waking_before_the_keeper_runs():
    clock = ManualClock()
    keeper = LeaseKeeper(clock=clock)
    locker = Locker(MemoryBackend(clock=clock), keeper=keeper, ttl=TTL)
    keeper.stop()  # the keeper thread never runs: only the term's own reading can tell
    with locker.leader(_name()) as term:
        assert term.leading and not term.lost.is_set()
        clock.advance(TTL)  # frozen past the deadline (SIGSTOP, a GC pause, swap)
        assert term.lost.is_set() and not term.leading
        with pytest.raises(LeaseLost, match="deadline"):
            term.check()


def test_a_wait_on_the_term_that_outlives_its_deadline_answers_lost():
    clock = ManualClock()
    keeper = LeaseKeeper(clock=clock)
    locker = Locker(MemoryBackend(clock=clock), keeper=keeper, ttl=TTL)
    keeper.stop()
    with locker.leader(_name()) as term:
        # The process "freezes" during the wait: the deadline passes while it blocks.
        timer = threading.Timer(0.02, clock.advance, args=(TTL,))
        timer.start()
        assert term.lost.wait(0.2) is True
        timer.join()


def test_leadership_changes_reach_the_metrics():
    metrics = Metrics(CollectorRegistry())
    locker = Locker(MemoryBackend(), ttl=TTL, on_leadership=metrics.observe_leadership)
    name = _name()
    key = leader_key(name)

    def sample(metric: str) -> float | None:
        return metrics.registry.get_sample_value(metric, {"election": key})

    try:
        with locker.leader(name) as term:
            assert sample("jobfence_leader") == 1
            assert sample("jobfence_leader_fence") == term.fence
        assert sample("jobfence_leader") == 0
        assert sample("jobfence_leader_terms_total") == 1
        assert sample("jobfence_leadership_lost_total") == 0
    finally:
        locker.close()


def test_an_elector_whose_on_elected_fails_resigns_and_campaigns_again():
    locker = Locker(MemoryBackend(), ttl=0.3)
    started: list[Term] = []

    def start(term: Term) -> None:
        started.append(term)
        if len(started) == 1:
            raise RuntimeError("cannot start the work")

    elector = locker.campaign(_name(), on_elected=start)
    try:
        wait_for(lambda: len(started) == 2 and elector.term is started[1], timeout=5)
        first, second = started
        assert first.lost.is_set() and first.cause is None  # resigned, not kept
        assert first.lease.released and second.fence > first.fence
    finally:
        elector.stop()
        locker.close()
