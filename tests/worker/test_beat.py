"""Beat leader election on real lock servers (Redis, PostgreSQL, MariaDB), and one run per
(entry, slot) even with two beats."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab, schedule

from jobfence.config import Settings
from jobfence.locks import LeaseKeeper, LockBackend, open_backend
from jobfence.locks.drive import run_sync
from jobfence.tasks import HEADER, runtime_for
from jobfence.worker.app import create_app
from jobfence.worker.beat import (
    LEADER_KEY,
    MAX_CATCHUP_SLOTS,
    LeaderScheduler,
    advance_mark_flow,
    catchup_since,
    format_slot,
    interval_slot,
    last_cron_fire,
    mark_key,
    missed_slots,
    read_mark_flow,
    slot_key,
    slot_task_id,
)
from tests.servers import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
TTL = 1.5
RECORD = "beat-test.record"  # the tasks in tests/worker/slot_app.py (not imported here: it
# builds an app on import, as `celery -A` needs)
RECORD_START = "beat-test.record-start"  # lock_until="start"
RECORD_UNIQUE = "beat-test.record-unique"  # unique_for=UNIQUE_FOR
UNIQUE_FOR = 1.0
ENTRY = "hourly-record"


class Clock:
    """The schedules' notion of now: fixed, moved by the test."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


# --------------------------------------------------------------------------- slots


@pytest.fixture
def utc_app() -> Iterator[Celery]:
    app = create_app(Settings(lock_url="memory://"), include=[], beat_schedule={})
    yield app
    runtime_for(app).close()


def test_interval_slots_are_aligned_to_the_epoch():
    now = datetime(2030, 1, 1, 2, 30, 7, 500000, tzinfo=UTC)
    assert interval_slot(timedelta(seconds=10), now) == datetime(2030, 1, 1, 2, 30, 0, tzinfo=UTC)
    assert interval_slot(timedelta(hours=1), now) == datetime(2030, 1, 1, 2, 0, tzinfo=UTC)


def test_a_crontab_slot_is_its_latest_firing_at_or_before_now(utc_app):
    nightly = crontab(minute=30, hour=2, app=utc_app)
    at = datetime(2030, 1, 2, 1, 0, tzinfo=UTC)
    assert last_cron_fire(nightly, at) == datetime(2030, 1, 1, 2, 30, tzinfo=UTC)
    exactly = datetime(2030, 1, 2, 2, 30, tzinfo=UTC)
    assert last_cron_fire(nightly, exactly) == exactly
    late = datetime(2030, 1, 2, 2, 31, 59, tzinfo=UTC)
    assert last_cron_fire(nightly, late) == exactly


def test_a_weekly_crontab_slot_goes_back_to_its_weekday(utc_app):
    mondays = crontab(minute=0, hour=6, day_of_week="mon", app=utc_app)
    wednesday = datetime(2030, 1, 2, 12, 0, tzinfo=UTC)  # 2030-01-02 is a Wednesday
    assert last_cron_fire(mondays, wednesday) == datetime(2029, 12, 31, 6, 0, tzinfo=UTC)


def test_the_slot_key_names_the_entry_and_the_utc_slot(utc_app):
    nightly = crontab(minute=30, hour=2, app=utc_app)
    entry = ScheduleEntry(name="nightly", task="t", schedule=nightly, app=utc_app)
    at = datetime(2030, 1, 1, 3, 0, tzinfo=UTC)
    assert slot_key(entry, at) == "nightly@2030-01-01T02:30:00Z"
    assert format_slot(datetime(2030, 1, 1, tzinfo=UTC) + timedelta(microseconds=5)) == (
        "2030-01-01T00:00:00.000005Z"
    )


def test_interval_entries_fall_due_once_per_aligned_period(utc_app):
    clock = Clock(datetime(2030, 1, 1, 2, 0, 3, tzinfo=UTC))
    sched = LeaderScheduler(utc_app, lazy=True)
    every10 = schedule(timedelta(seconds=10), nowfun=clock, app=utc_app)
    entry = ScheduleEntry(
        name="every10", task="t", schedule=every10, last_run_at=clock.now, app=utc_app
    )
    due, wait = sched.is_due(entry)
    assert not due and wait == pytest.approx(7.0)
    clock.now += timedelta(seconds=7)  # 02:00:10, the next grid point
    due, wait = sched.is_due(entry)
    assert due and wait == pytest.approx(10.0)


def test_the_missed_slots_are_those_after_since_and_before_the_current_one(utc_app):
    now = datetime(2030, 1, 1, 2, 30, 5, tzinfo=UTC)
    every10 = schedule(timedelta(seconds=10), app=utc_app)
    entry = ScheduleEntry(name="e", task="t", schedule=every10, last_run_at=now, app=utc_app)
    since = datetime(2030, 1, 1, 2, 29, 40, tzinfo=UTC)  # the 02:29:40 slot ran by then
    assert missed_slots(entry, now, since) == [datetime(2030, 1, 1, 2, 29, 50, tzinfo=UTC)]
    assert missed_slots(entry, now, now) == []  # the current slot is the tick's, not missed
    long_ago = now - timedelta(days=1)  # bounded: the latest MAX_CATCHUP_SLOTS only
    slots = missed_slots(entry, now, long_ago)
    assert len(slots) == MAX_CATCHUP_SLOTS
    assert slots[-1] == datetime(2030, 1, 1, 2, 29, 50, tzinfo=UTC)
    assert slots == sorted(slots)


def test_the_missed_slots_of_a_crontab_walk_back_its_firings(utc_app):
    every10 = crontab(minute="*/10", app=utc_app)
    entry = ScheduleEntry(name="c", task="t", schedule=every10, app=utc_app)
    now = datetime(2030, 1, 1, 2, 31, 0, tzinfo=UTC)  # current slot 02:30
    since = datetime(2030, 1, 1, 2, 5, 0, tzinfo=UTC)
    assert missed_slots(entry, now, since) == [
        datetime(2030, 1, 1, 2, 10, tzinfo=UTC),
        datetime(2030, 1, 1, 2, 20, tzinfo=UTC),
    ]


def test_the_catch_up_starts_after_the_fleet_s_last_slot_within_the_window():
    """Issue 29 #4: measured from what the fleet last dispatched, not this process's start."""
    now = datetime(2030, 1, 1, 2, 30, 5, tzinfo=UTC)
    started = now - timedelta(seconds=1)  # a beat restarted a second ago
    mark = now - timedelta(seconds=3)  # the dead leader's last slot
    assert catchup_since(now, 4.0, mark, started) == mark
    old = now - timedelta(hours=1)  # a mark older than the window: the window bounds it
    assert catchup_since(now, 4.0, old, started) == now - timedelta(seconds=4)
    assert catchup_since(now, 4.0, None, started) == started  # never dispatched: own start
    assert catchup_since(now, 0.0, mark, started) == now  # catch-up off


def test_a_slot_has_one_task_id_whoever_dispatches_it():
    one = slot_task_id("fleet", "t", "e@2030-01-01T02:00:00Z")
    assert one == slot_task_id("fleet", "t", "e@2030-01-01T02:00:00Z")
    assert str(uuid.UUID(one)) == one
    assert one != slot_task_id("fleet", "t", "e@2030-01-01T03:00:00Z")
    assert one != slot_task_id("other", "t", "e@2030-01-01T02:00:00Z")  # another fleet
    assert one != slot_task_id("fleet", "u", "e@2030-01-01T02:00:00Z")  # another task


def test_the_fleet_s_last_slot_never_moves_back(utc_app):
    backend = runtime_for(utc_app).backend
    key = mark_key(LEADER_KEY, "nightly {report}*")  # any entry name makes a valid key

    def read() -> str | None:
        return run_sync(read_mark_flow(key), backend, backend.clock)

    def advance(at: datetime, seen: str | None = None) -> datetime:
        return run_sync(advance_mark_flow(key, at, seen), backend, backend.clock)

    two, three = (datetime(2030, 1, 1, h, tzinfo=UTC) for h in (2, 3))
    assert read() is None
    assert advance(two) == two and read() == format_slot(two)
    assert advance(three, seen=None) == three  # a stale view of the mark still moves it on
    assert read() == format_slot(three)
    assert advance(two, seen=format_slot(two)) == three  # a late, older dispatch: kept
    assert read() == format_slot(three)
    backend.swap_publish(key, format_slot(three), "not a slot", 60)
    assert advance(two) == two  # what is not a slot is replaced


def test_a_beat_started_after_a_crontab_slot_fell_dispatches_it(utc_app):
    """The crontab twin of issue 29 #4, on the memory backend: the leader goes after the
    02:00 firing, a fresh beat starts in the 03:00 minute after it fell, and sends it."""
    clock = Clock(datetime(2030, 1, 1, 2, 0, 20, tzinfo=UTC))
    hourly = crontab(minute=0, nowfun=clock, app=utc_app)
    utc_app.conf.beat_schedule = {"c": {"task": "t", "schedule": hourly}}
    utc_app.conf.jobfence_beat_catchup = 3600
    sent: list[tuple[str, str]] = []
    keepers: list[LeaseKeeper] = []

    def beat() -> LeaderScheduler:
        keepers.append(LeaseKeeper(fraction=1 / 3))
        sched = LeaderScheduler(utc_app, keeper=keepers[-1])
        sched.schedule["c"].last_run_at = clock.now  # a beat's entries start at its start
        sched.send_task = lambda name, *a, **kw: sent.append(  # type: ignore[method-assign]
            (kw["headers"][HEADER], kw.get("task_id"))
        )
        return sched

    try:
        a = beat()
        a.schedule["c"].last_run_at = clock.now - timedelta(hours=1)
        a.tick()
        assert [k for k, _ in sent] == ["c@2030-01-01T02:00:00Z"]
        a.close()  # gone (killed or not: the next leader's catch-up is the same)
        clock.now = datetime(2030, 1, 1, 3, 0, 30, tzinfo=UTC)  # 03:00 fell with no leader
        b = beat()  # started after it, in its minute: on main, neither missed nor due
        b.tick()
        assert [k for k, _ in sent] == ["c@2030-01-01T02:00:00Z", "c@2030-01-01T03:00:00Z"]
        b.tick()
        assert len(sent) == 2
        assert sent[1][1] == slot_task_id(b.fleet, "t", "c@2030-01-01T03:00:00Z")
    finally:
        for keeper in keepers:
            keeper.stop()


# --------------------------------------------------------------------------- election


LOCK_BACKENDS = ["redis", "postgres", "mariadb"]


@pytest.fixture(params=LOCK_BACKENDS)
def lock_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """Where the beats elect their leader; the broker stays on the private Redis."""
    if request.param == "redis":
        return redis_url
    url: str = request.getfixturevalue("pg_url" if request.param == "postgres" else "mariadb_url")
    return url


@pytest.fixture
def settings(lock_url: str, redis_url: str) -> Settings:
    return beat_settings(lock_url, redis_url)


def beat_settings(lock_url: str, redis_url: str) -> Settings:
    # A prefix of its own per test: the SQL databases live for the session, and a leader
    # that "died" in one test must not hold the next test's leader key.
    return Settings(
        lock_url=lock_url,
        broker_url=_db(redis_url, 1),
        result_backend=_db(redis_url, 2),
        key_prefix=f"bt{uuid.uuid4().hex[:8]}",
        default_ttl=TTL,
        socket_timeout=0.3,
    )


def open_lock_backend(settings: Settings) -> LockBackend:
    """A second client of the beats' lock backend (an operator, the test's eyes)."""
    return open_backend(
        settings.lock_url, prefix=settings.key_prefix, socket_timeout=settings.socket_timeout
    )


@pytest.fixture
def clock() -> Clock:
    return Clock(datetime(2030, 1, 1, 2, 30, 5, tzinfo=UTC))


@pytest.fixture
def beat_app(settings: Settings, clock: Clock) -> Iterator[Celery]:
    app = create_app(
        settings,
        include=[],
        beat_schedule={
            ENTRY: {"task": RECORD, "schedule": schedule(timedelta(hours=1), nowfun=clock)}
        },
    )
    yield app
    runtime_for(app).close()


@pytest.fixture
def make_scheduler(beat_app: Celery, clock: Clock) -> Iterator[Callable[..., LeaderScheduler]]:
    """Schedulers with a keeper each (so one can die alone); the entry is due at once."""
    made: list[tuple[LeaderScheduler, LeaseKeeper]] = []

    def build(**kwargs: Any) -> LeaderScheduler:
        keeper = LeaseKeeper(fraction=1 / 3)
        sched = LeaderScheduler(beat_app, keeper=keeper, **kwargs)
        sched.schedule[ENTRY].last_run_at = clock.now - timedelta(hours=2)
        made.append((sched, keeper))
        return sched

    yield build
    for sched, keeper in made:
        sched.close()
        keeper.stop()


def _db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture
def broker(redis_url: str) -> Iterator[redis.Redis]:
    """The broker database (1) of the shared server."""
    client = redis.Redis.from_url(_db(redis_url, 1))
    yield client
    client.close()


def queued(broker: redis.Redis) -> list[dict[str, Any]]:
    """The messages waiting in the default queue, oldest first."""
    return [json.loads(raw) for raw in reversed(broker.lrange("celery", 0, -1))]


def run_beat(sched: LeaderScheduler, until: Callable[[], bool], timeout: float) -> float:
    """Drive `sched` as `celery beat` does (tick, sleep what it asks, looking at `until()`
    at least every standby poll) until `until()`; return the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        wait = min(sched.tick(), sched.standby_poll, deadline - time.monotonic())
        time.sleep(max(0.0, wait))
    return time.monotonic() - started


def test_only_the_leader_dispatches(make_scheduler, broker, settings):
    a, b = make_scheduler(), make_scheduler()
    for _ in range(3):
        a.tick()
        b.tick()
    assert a.is_leader and not b.is_leader
    messages = queued(broker)
    assert len(messages) == 1
    assert messages[0]["headers"][HEADER] == f"{ENTRY}@2030-01-01T02:00:00Z"
    backend = open_lock_backend(settings)
    try:
        info = backend.inspect(LEADER_KEY)
    finally:
        backend.close()
    assert info is not None and a.lease is not None and info.fence == a.lease.fence
    assert info.pid == os.getpid() and info.task_name == "celery.beat"


def test_the_leader_keeps_its_lease_past_the_ttl(make_scheduler, broker):
    a, b = make_scheduler(), make_scheduler()
    a.tick()
    b.tick()
    deadline = time.monotonic() + 2 * TTL
    while time.monotonic() < deadline:  # two TTLs of standby polling, as beat would
        time.sleep(b.tick())
        assert not b.is_leader
    assert a.is_leader


def test_a_standby_takes_over_within_one_ttl_after_the_leader_dies(make_scheduler, broker):
    a, b = make_scheduler(), make_scheduler()
    a.tick()
    b.tick()
    assert a.is_leader and not b.is_leader
    a.keeper.stop()  # the leader dies: no release, no more heartbeats
    took = run_beat(b, lambda: b.is_leader, timeout=3 * TTL)
    assert took <= TTL + b.standby_poll + 0.3
    assert not a.is_leader  # past its deadline: it would not dispatch if it woke up
    # The new leader reads the slot the old one dispatched last from the lock server, and
    # does not send it again.
    keys = [m["headers"][HEADER] for m in queued(broker)]
    assert keys == [f"{ENTRY}@2030-01-01T02:00:00Z"]


def test_a_new_leader_dispatches_the_slot_that_fell_during_the_hand_over(
    make_scheduler, broker, beat_app, clock
):
    """Issue 18 #9: a slot that fell while no leader was dispatching runs once, from the
    new leader, before the current slot; on main it was lost."""
    beat_app.conf.jobfence_beat_catchup = 2 * 3600  # two of the hourly entry's periods
    a, b = make_scheduler(), make_scheduler()
    a.tick()
    b.tick()
    assert a.is_leader and not b.is_leader
    a.keeper.stop()  # the leader dies
    clock.now += timedelta(hours=2)  # 04:30:05: the 03:00 slot fell with no leader
    run_beat(b, lambda: b.is_leader, timeout=3 * TTL)
    keys = [m["headers"][HEADER] for m in queued(broker)]
    assert keys == [
        f"{ENTRY}@2030-01-01T01:00:00Z",  # a, catching up (the entry last ran at 00:30:05)
        f"{ENTRY}@2030-01-01T02:00:00Z",  # a
        f"{ENTRY}@2030-01-01T03:00:00Z",  # b, catching up the slot nobody dispatched
        f"{ENTRY}@2030-01-01T04:00:00Z",  # b, the current slot
    ]
    b.tick()  # and nothing twice: the catch-up is done once per term
    assert len(queued(broker)) == 4


def test_the_catch_up_window_bounds_what_a_new_leader_dispatches(make_scheduler, broker, clock):
    a, b = make_scheduler(), make_scheduler()  # default window: two TTLs (3 s here)
    a.tick()
    b.tick()
    a.keeper.stop()
    clock.now += timedelta(hours=2)  # the 03:00 slot is far older than the window
    run_beat(b, lambda: b.is_leader, timeout=3 * TTL)
    keys = [m["headers"][HEADER] for m in queued(broker)]
    assert keys == [f"{ENTRY}@2030-01-01T02:00:00Z", f"{ENTRY}@2030-01-01T04:00:00Z"]


def test_a_beat_started_after_the_leader_died_dispatches_the_slots_that_fell_meanwhile(
    make_scheduler, broker, beat_app, clock, settings
):
    """Issue 29 #4: a beat started after the leader died (restarted by its supervisor, not a
    standby that was running) starts its catch-up after the dead leader's last slot, read on
    the lock server. On main it started from its own start: it sent neither the slot that
    fell with no leader nor the current one (not due: it started in its period)."""
    beat_app.conf.jobfence_beat_catchup = 2 * 3600
    a = make_scheduler()
    run_beat(a, lambda: a.is_leader, timeout=3 * TTL)  # one tick, unless the suite's load
    # made the first election's round trip late
    a.keeper.stop()  # killed
    clock.now += timedelta(hours=2)  # 04:30:05: the 03:00 slot fell with no leader
    b = make_scheduler()
    b.schedule[ENTRY].last_run_at = clock.now  # started just now
    run_beat(b, lambda: b.is_leader, timeout=3 * TTL)
    b.tick()
    messages = queued(broker)
    keys = [m["headers"][HEADER] for m in messages]
    assert keys == [
        f"{ENTRY}@2030-01-01T01:00:00Z",  # a, catching up (the entry last ran at 00:30:05)
        f"{ENTRY}@2030-01-01T02:00:00Z",  # a
        f"{ENTRY}@2030-01-01T03:00:00Z",  # b, after a's last slot
        f"{ENTRY}@2030-01-01T04:00:00Z",  # b, the current slot
    ]
    ids = [m["headers"]["id"] for m in messages]
    assert ids == [slot_task_id(settings.key_prefix, RECORD, key) for key in keys]


def test_a_leader_killed_before_its_first_mark_leaves_its_successor_where_to_catch_up(
    make_scheduler, broker, beat_app, clock
):
    """Issue 29 (found by the model's beat_restart): the fleet's first leader is killed after
    each publish, before the slot's mark is written. A beat restarted after a slot fell
    catches up from the slot the first leader started covering (stored at its election); on
    main the lock server had no mark, so the window started at the new beat's own start and
    the slot that fell meanwhile, and the current one, were never sent."""
    beat_app.conf.jobfence_beat_catchup = 2 * 3600
    a = make_scheduler()
    started = datetime(2030, 1, 1, 0, 0, tzinfo=UTC)  # the slot of a's start (00:30:05)
    record = a.record_slot
    a.record_slot = lambda entry, at: record(entry, at) if at <= started else None
    run_beat(a, lambda: a.is_leader, timeout=3 * TTL)  # one tick, unless the suite's load
    # made the first election's round trip late
    a.keeper.stop()  # killed
    clock.now += timedelta(hours=2)  # 04:30:05: the 03:00 slot fell with no leader
    b = make_scheduler()
    b.schedule[ENTRY].last_run_at = clock.now  # started just now
    run_beat(b, lambda: b.is_leader, timeout=3 * TTL)
    b.tick()
    keys = [m["headers"][HEADER] for m in queued(broker)]
    assert keys == [
        f"{ENTRY}@2030-01-01T01:00:00Z",  # a, catching up (its marks lost)
        f"{ENTRY}@2030-01-01T02:00:00Z",  # a
        f"{ENTRY}@2030-01-01T03:00:00Z",  # b, catching up after the slot a started at
        f"{ENTRY}@2030-01-01T04:00:00Z",  # b, the current slot
    ]


def test_a_bad_catch_up_window_is_refused_with_its_name(beat_app):
    beat_app.conf.jobfence_beat_catchup = "nan"
    with pytest.raises(ValueError, match="jobfence_beat_catchup"):
        LeaderScheduler(beat_app, lazy=True)


def test_a_leader_that_shuts_down_hands_over_at_once(make_scheduler):
    a, b = make_scheduler(), make_scheduler()
    a.tick()
    b.tick()
    a.close()
    b.tick()
    assert b.is_leader


def test_the_beat_leadership_shows_in_the_metrics(make_scheduler, beat_app):
    a, b = make_scheduler(), make_scheduler()
    a.tick()
    b.tick()
    registry = runtime_for(beat_app).metrics.registry

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name, {"election": LEADER_KEY})

    assert a.lease is not None and sample("jobfence_leader") == 1
    assert sample("jobfence_leader_fence") == a.lease.fence
    a.close()  # hands over: b leads at its next tick
    assert sample("jobfence_leader") == 0
    b.tick()
    assert b.lease is not None and sample("jobfence_leader") == 1
    assert sample("jobfence_leader_fence") == b.lease.fence
    assert sample("jobfence_leader_terms_total") == 2
    assert sample("jobfence_leadership_lost_total") == 0


def test_a_leader_that_lost_its_lease_stops_dispatching(make_scheduler, broker, settings, clock):
    a, b = make_scheduler(), make_scheduler()
    a.tick()
    assert len(queued(broker)) == 1
    backend = open_lock_backend(settings)
    try:
        backend.force_release(LEADER_KEY)  # e.g. an operator, or the lock server lost it
    finally:
        backend.close()
    b.tick()
    assert b.is_leader
    wait_for(
        lambda: a.lease is None or a.lease.lost,
        timeout=2 * TTL,
        message="the old leader never noticed it lost the lease",
    )
    clock.now += timedelta(hours=1)  # the next slot falls due
    a.tick()
    assert not a.is_leader
    b.tick()
    keys = [m["headers"][HEADER] for m in queued(broker)]
    assert keys == [
        f"{ENTRY}@2030-01-01T02:00:00Z",  # a, as leader (b read it on the lock server)
        f"{ENTRY}@2030-01-01T03:00:00Z",  # b only
    ]


# --------------------------------------------------------------------------- real processes


def jobfence_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The JOBFENCE_* variables that give a `celery` process these settings."""
    env = {
        "JOBFENCE_LOCK_URL": settings.lock_url,
        "JOBFENCE_BROKER_URL": settings.broker_url or "",
        "JOBFENCE_RESULT_BACKEND": settings.result_backend or "",
        "JOBFENCE_KEY_PREFIX": settings.key_prefix,
        "JOBFENCE_DEFAULT_TTL": str(settings.default_ttl),
        "JOBFENCE_SOCKET_TIMEOUT": str(settings.socket_timeout),
    }
    return {**env, **extra}


def test_two_real_beats_elect_one_and_the_standby_takes_over_after_a_kill(
    settings, process_group, tmp_path
):
    ttl = 2.0
    env = jobfence_env(settings, JOBFENCE_DEFAULT_TTL=str(ttl), JOBFENCE_SOCKET_TIMEOUT="0.5")
    beats = [
        process_group.spawn(
            [sys.executable, "-m", "celery", "-A", "demo.app", "beat",
             "-l", "INFO", "-s", str(tmp_path / f"beat-{i}-schedule")],
            env=env, cwd=REPO_ROOT, name=f"beat-{i}",
        )
        for i in range(2)
    ]  # fmt: skip
    pids = {p.pid for p in beats}
    backend = open_lock_backend(settings)
    try:

        def leader_pid() -> int | None:
            info = backend.inspect(LEADER_KEY)
            return info.pid if info is not None and info.pid in pids else None

        first = wait_for(leader_pid, timeout=60, message=lambda: process_group.log_of(beats[0]))
        leader = next(p for p in beats if p.pid == first)
        standby = next(p for p in beats if p.pid != first)
        os.killpg(leader.pid, signal.SIGKILL)  # our own child's group; the harness reaps it
        killed_at = time.monotonic()
        wait_for(
            lambda: leader_pid() == standby.pid,
            timeout=3 * ttl,
            message=lambda: process_group.log_of(standby),
        )
        took = time.monotonic() - killed_at
        assert took <= ttl + 1.0, took
        assert standby.poll() is None
    finally:
        backend.close()


def test_two_beats_dispatching_the_same_slot_run_the_task_once(
    make_scheduler, broker, clock, settings, redis_url, process_group
):
    # Split brain: each beat holds its own leader key, so both dispatch every slot.
    a = make_scheduler(leader_key="beat-leader-a")
    b = make_scheduler(leader_key="beat-leader-b")
    for _ in range(2):
        a.tick()
        b.tick()
    assert a.is_leader and b.is_leader
    assert len(queued(broker)) == 2  # each dispatched the 02:00 slot once
    clock.now += timedelta(hours=1)
    a.tick()
    b.tick()
    keys = [m["headers"][HEADER] for m in queued(broker)]
    assert keys == [f"{ENTRY}@2030-01-01T02:00:00Z"] * 2 + [f"{ENTRY}@2030-01-01T03:00:00Z"] * 2

    record = redis.Redis.from_url(_db(redis_url, 3))
    env = jobfence_env(settings, SLOT_RECORD_URL=_db(redis_url, 3))
    worker = process_group.spawn(
        [sys.executable, "-m", "celery", "-A", "tests.worker.slot_app", "worker",
         "--pool", "solo", "-l", "INFO", "--without-gossip", "--without-mingle"],
        env=env, cwd=REPO_ROOT, name="slot-worker",
    )  # fmt: skip
    wait_for(
        lambda: broker.llen("celery") == 0 and broker.hlen("unacked") == 0,
        timeout=60,
        message=lambda: process_group.log_of(worker),
    )
    runs = [json.loads(r) for r in record.lrange("runs", 0, -1)]
    record.close()
    assert len(runs) == 2, runs
    assert len({r["key"] for r in runs}) == 2


def start_slot_worker(settings: Settings, redis_url: str, process_group: Any) -> Any:
    """A real `celery worker` (solo pool) of tests/worker/slot_app.py."""
    env = jobfence_env(settings, SLOT_RECORD_URL=_db(redis_url, 3))
    return process_group.spawn(
        [sys.executable, "-m", "celery", "-A", "tests.worker.slot_app", "worker",
         "--pool", "solo", "-l", "INFO", "--without-gossip", "--without-mingle"],
        env=env, cwd=REPO_ROOT, name="slot-worker",
    )  # fmt: skip


def drained(broker: redis.Redis) -> bool:
    return broker.llen("celery") == 0 and broker.hlen("unacked") == 0


def tick_until_idle(sched: LeaderScheduler) -> None:
    """Tick until nothing is due (Celery's tick sends one due entry and asks to come back at
    once; then it asks to come back when the next falls due)."""
    for _ in range(20):
        if sched.tick() > 1:
            return
    raise AssertionError("the scheduler never came to rest")


@pytest.mark.integration
@pytest.mark.slow
def test_a_slot_sent_again_runs_once_under_every_lifetime(
    settings, broker, clock, redis_url, process_group
):
    """Issue 29 #5: every copy of a slot is the same run (one task id), so a per-run
    lifetime's record answers a copy sent again: here by a second leader (split brain) after
    the first copy ran and its unique_for lapsed. On main the copies had task ids of their
    own: with lock_until="start" and unique_for each ran twice. Control: two naive copies of
    one key (task ids of their own, as main's beat sent) run twice under both lifetimes."""
    tasks = (RECORD, RECORD_START, RECORD_UNIQUE)
    app = create_app(
        settings,
        include=[],
        beat_schedule={
            task: {"task": task, "schedule": schedule(timedelta(hours=1), nowfun=clock)}
            for task in tasks
        },
    )
    keepers = [LeaseKeeper(fraction=1 / 3) for _ in range(2)]
    beats = [
        LeaderScheduler(app, keeper=keeper, leader_key=f"beat-leader-{i}")
        for i, keeper in enumerate(keepers)
    ]
    for sched in beats:
        for entry in sched.schedule.values():
            entry.last_run_at = clock.now - timedelta(hours=2)
    control = "control@2030-01-01T02:00:00Z"  # a key of its own, sent twice
    record = redis.Redis.from_url(_db(redis_url, 3))
    worker = None
    try:
        for phase, sched in enumerate(beats, start=1):
            tick_until_idle(sched)  # sends the 02:00 slot of each entry
            assert sched.is_leader
            for task in (RECORD_START, RECORD_UNIQUE):
                app.send_task(task, headers={HEADER: control})  # naive: an id of its own
            worker = worker or start_slot_worker(settings, redis_url, process_group)
            least = 3 + 2 * phase  # the slots' first runs, and each naive copy's
            wait_for(
                lambda least=least: drained(broker) and record.llen("runs") >= least,
                timeout=60,
                message=lambda w=worker: process_group.log_of(w),
            )
            # unique_for throttles a copy while it lasts: the second leader's copies (and
            # the second naive ones) come after it lapsed
            time.sleep(UNIQUE_FOR + 0.5)
        runs = [json.loads(r) for r in record.lrange("runs", 0, -1)]
    finally:
        record.close()
        for sched, keeper in zip(beats, keepers, strict=True):
            sched.close()
            keeper.stop()
        runtime_for(app).close()
    # Per task, the runs of each job key: the slot's (one key for both leaders' copies)
    # and, for the per-run lifetimes, the naive control's.
    per_key = {
        task: sorted(Counter(r["key"] for r in runs if r["task"] == task).values())
        for task in tasks
    }
    assert per_key == {RECORD: [1], RECORD_START: [1, 2], RECORD_UNIQUE: [1, 2]}, runs


#: The supervisor's restart delay in issue 29 #4 (TTL 2 s): the restarted beat starts after
#: at least one slot fell with the leader dead.
RESTART_DELAY = 1.6
START = 60.0  # seconds a `celery beat` may take to start and lead on a loaded box


@pytest.mark.fault
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("catchup", [60.0, 0.0], ids=["catch-up", "control-catch-up-off"])
def test_a_beat_restarted_after_a_kill_dispatches_the_slots_that_fell_meanwhile(
    catchup, redis_url, broker, process_group, tmp_path
):
    """Issue 29 #4 with real `celery beat` processes: the leader (a slot every second, TTL
    2 s) is SIGKILLed and restarted 1.6 s later, with no standby running. The restarted beat
    sends every slot that fell after the dead leader's last one, each under the slot's own
    task id. On main it started its catch-up at its own start: the slots between were never
    sent. Control: with the catch-up off, the same restart leaves a slot unsent, so the
    slots checked really fell while no beat led."""
    settings = beat_settings(redis_url, redis_url)
    env = jobfence_env(
        settings, JOBFENCE_DEFAULT_TTL="2.0", JOBFENCE_SOCKET_TIMEOUT="0.5",
        SLOT_BEAT_EVERY="1", SLOT_BEAT_CATCHUP=str(catchup),
    )  # fmt: skip

    def beat(name: str) -> Any:
        return process_group.spawn(
            [sys.executable, "-m", "celery", "-A", "tests.worker.slot_app", "beat",
             "-l", "INFO", "-s", str(tmp_path / f"{name}-schedule")],
            env=env, cwd=REPO_ROOT, name=name,
        )  # fmt: skip

    def sent() -> dict[datetime, set[str]]:
        """Each slot in the broker, with the task ids of its messages."""
        slots: dict[datetime, set[str]] = {}
        for message in queued(broker):
            at = datetime.fromisoformat(message["headers"][HEADER].split("@", 1)[1])
            slots.setdefault(at, set()).add(message["headers"]["id"])
        return slots

    first = beat("beat-first")
    wait_for(lambda: len(sent()) >= 2, timeout=START, message=lambda: process_group.log_of(first))
    os.killpg(first.pid, signal.SIGKILL)  # our own child's group; the harness reaps it
    killed = time.time()
    last_of_first = max(sent())  # it sends no more
    time.sleep(RESTART_DELAY)  # the scenario: the supervisor restarts it this much later
    restarted = beat("beat-restarted")
    fell = datetime.fromtimestamp(killed + RESTART_DELAY, UTC)  # before the restart
    wait_for(
        lambda: max(sent()) > fell + timedelta(seconds=1),
        timeout=START,
        message=lambda: process_group.log_of(restarted),
    )
    slots = sent()
    gap = [
        at
        for at in (last_of_first + timedelta(seconds=n) for n in range(1, 10))
        if at <= fell and at not in slots
    ]
    if catchup:
        assert gap == [], (gap, process_group.log_of(restarted))
        for at, ids in slots.items():  # one task id per slot, whoever sent it
            assert ids == {slot_task_id(settings.key_prefix, RECORD, f"every@{format_slot(at)}")}
    else:
        assert gap, "no slot fell between the kill and the restart: the scenario was not met"
