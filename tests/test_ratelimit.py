"""The GCRA rate limiter on an injected clock: rate strings, the window bound, the plain API
and the executor's gate (lease first, then the turn; retry, wait and skip)."""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobfence.locks import (
    Backoff,
    LeaseKeeper,
    LockError,
    ManualClock,
    MemoryBackend,
    Rate,
    RateLimited,
    RateLimiter,
    parse_rate,
)
from jobfence.locks.ratelimit import gcra
from jobfence.tasks import Executor, JobSpec
from jobfence.tasks.executor import RateSpec
from jobfence.tasks.metrics import Metrics


@pytest.mark.parametrize(
    ("text", "count", "period"),
    [("100/m", 100, 60), ("5/s", 5, 1), ("2/h", 2, 3600), (" 0.5 / s ", 0.5, 1)],
)
def test_rate_strings_read_like_celerys(text: str, count: float, period: float) -> None:
    rate = parse_rate(text)
    assert (rate.count, rate.period, rate.interval) == (count, period, period / count)


@pytest.mark.parametrize("text", ["100", "100/d", "0/s", "-3/m", "ten/m", "", None, 100])
def test_a_bad_rate_string_names_the_option_and_the_format(text: object) -> None:
    with pytest.raises(LockError, match=r'global_rate_limit must be "N/s", "N/m" or "N/h"'):
        parse_rate(text, option="global_rate_limit")


def test_burst_must_be_a_whole_number_of_at_least_one() -> None:
    with pytest.raises(LockError, match="burst"):
        Rate(10, 1, burst=0)


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.floats(0, 3, allow_nan=False), min_size=1, max_size=120),
    waits=st.lists(st.sampled_from([0.0, 0.0, 0.5, 5.0, -1.0]), min_size=120, max_size=120),
    interval=st.floats(0.05, 2.0),
    burst=st.integers(1, 5),
    window=st.floats(0.1, 20.0),
)
def test_no_window_admits_more_than_rate_times_length_plus_burst(
    gaps: list[float], waits: list[float], interval: float, burst: int, window: float
) -> None:
    """Over any window of length T, events admitted (at the time they were told to act)
    number at most T / interval + burst, whatever the arrivals and waits asked for."""
    tat, now, starts = 0.0, 1000.0, []
    for gap, max_wait in zip(gaps, waits, strict=False):
        now += gap
        admitted, wait, tat = gcra(tat, now, interval, burst, max_wait)
        if admitted:
            assert wait <= max_wait
            starts.append(now + wait)
    starts.sort()
    bound = window / interval + burst + 1e-9
    for i, first in enumerate(starts):
        assert bisect.bisect_right(starts, first + window) - i <= bound


def test_steady_demand_is_admitted_at_exactly_the_rate() -> None:
    clock = ManualClock()
    limiter = RateLimiter(MemoryBackend(clock=clock), "api", "10/s")
    start = clock.monotonic()
    for _ in range(50):
        limiter.acquire()
    assert clock.monotonic() - start == pytest.approx(4.9)  # the first at once, then 0.1 s apart


@pytest.fixture
def limiter() -> Iterator[tuple[RateLimiter, ManualClock, Metrics]]:
    clock, metrics = ManualClock(), Metrics()
    lim = RateLimiter(MemoryBackend(clock=clock), "api:stripe", "2/s", metrics=metrics)
    yield lim, clock, metrics


def test_try_acquire_says_how_long_to_wait_and_takes_nothing(
    limiter: tuple[RateLimiter, ManualClock, Metrics],
) -> None:
    lim, clock, metrics = limiter
    assert lim.try_acquire() == 0.0
    assert lim.try_acquire() == pytest.approx(0.5)
    clock.advance(0.2)
    assert lim.try_acquire() == pytest.approx(0.3)  # the refusals took no turn
    clock.advance(0.3)
    assert lim.try_acquire() == 0.0
    denied = metrics.registry.get_sample_value(
        "jobfence_rate_limit_denials_total", {"limit": "api:stripe", "action": "try"}
    )
    assert denied == 2


def test_acquire_beyond_its_timeout_raises_with_the_wait(
    limiter: tuple[RateLimiter, ManualClock, Metrics],
) -> None:
    lim, clock, _ = limiter
    lim.acquire()
    lim.acquire(timeout=1.0)  # reserved 0.5 s ahead, slept out
    assert clock.now == pytest.approx(1000.5)
    with pytest.raises(RateLimited, match=r"rate limit 2/s not available within 0\.1s") as err:
        lim.acquire(timeout=0.1)
    assert err.value.retry_after == pytest.approx(0.5)


def test_context_manager_and_decorator_wait_for_a_turn(
    limiter: tuple[RateLimiter, ManualClock, Metrics],
) -> None:
    lim, clock, _ = limiter
    calls: list[float] = []

    @lim
    def call() -> None:
        calls.append(clock.monotonic())

    with lim:
        calls.append(clock.monotonic())
    call()
    call()
    assert calls == pytest.approx([1000.0, 1000.5, 1001.0])


# ------------------------------------------------------------------ the executor's gate
@pytest.fixture
def gate() -> Iterator[tuple[Executor, ManualClock, Metrics]]:
    clock, metrics, keeper = ManualClock(), Metrics(), LeaseKeeper()
    yield (
        Executor(MemoryBackend(clock=clock), keeper, backoff=Backoff(), metrics=metrics),
        clock,
        metrics,
    )
    keeper.stop()


def _spec(
    key: str,
    policy: str = "retry",
    *,
    slot: float | None = None,
    every: float = 2.0,
    wait: float = 5.0,
) -> JobSpec:
    rate = RateSpec(key="tests.rated", label="tests.rated", interval=every,
                    on_limited=policy, wait_timeout=wait, slot=slot)  # type: ignore[arg-type]  # fmt: skip
    return JobSpec(name="tests.rated", key=key, fingerprint="fp-" + key, ttl=30, result_ttl=600,
                   rate=rate)  # fmt: skip


def _count(metrics: Metrics, action: str) -> float:
    if action == "admitted":  # admissions, waits of 0 included
        labels = {"limit": "tests.rated"}
        name = "jobfence_rate_limit_wait_seconds_count"
    else:
        labels = {"limit": "tests.rated", "action": action}
        name = "jobfence_rate_limit_denials_total"
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_retry_reserves_the_turn_and_the_copy_spends_no_other(
    gate: tuple[Executor, ManualClock, Metrics],
) -> None:
    ex, clock, metrics = gate
    assert ex.run(_spec("a"), lambda _: 1).status == "ran"
    out = ex.run(_spec("b"), lambda _: 2)
    assert (out.status, out.countdown, out.slot) == ("rate_limited", 2.0, pytest.approx(1002.0))
    assert ex.backend.inspect("b") is None  # the lease was given back for the wait
    assert _count(metrics, "retry") == 1
    clock.advance(2.0)
    again = ex.run(_spec("b", slot=out.slot), lambda _: 2)
    assert (again.status, again.value) == ("ran", 2)
    third = ex.run(_spec("c"), lambda _: 3)  # b's turn was spent: c gets the next one
    assert third.status == "rate_limited" and third.countdown == pytest.approx(2.0)


def test_retry_sleeps_out_a_wait_under_a_second_in_the_worker(
    gate: tuple[Executor, ManualClock, Metrics],
) -> None:
    ex, clock, metrics = gate
    for key in "ab":
        assert ex.run(_spec(key, every=0.5), lambda _: 1).status == "ran"
    assert clock.now == pytest.approx(1000.5)
    assert _count(metrics, "admitted") == 2


def test_a_copy_early_for_its_turn_sleeps_out_a_short_slack_and_defers_a_long_one(
    gate: tuple[Executor, ManualClock, Metrics],
) -> None:
    ex, clock, _ = gate
    assert ex.run(_spec("a", slot=clock.now + 0.3), lambda _: 1).status == "ran"
    assert clock.now == pytest.approx(1000.3)
    far = ex.run(_spec("b", slot=clock.now + 30), lambda _: 1)
    assert (far.status, far.countdown, far.slot) == ("rate_limited", pytest.approx(30), far.slot)


def test_a_copy_late_for_its_turn_starts_when_the_fleet_has_a_free_start(
    gate: tuple[Executor, ManualClock, Metrics],
) -> None:
    ex, clock, _ = gate
    assert ex.run(_spec("a"), lambda _: 1).status == "ran"
    clock.advance(10.0)  # the broker held b's copy back well past its turn
    assert ex.run(_spec("b", slot=clock.now - 5.0), lambda _: 1).status == "ran"


def test_late_copies_never_bunch_the_excess_takes_new_turns(
    gate: tuple[Executor, ManualClock, Metrics],
) -> None:
    ex, clock, metrics = gate
    assert ex.run(_spec("a"), lambda _: 1).status == "ran"  # the next start: +2 s
    late = ex.run(_spec("b", slot=clock.now - 5.0), lambda _: 1)  # starting now would bunch
    assert (late.status, late.countdown, late.slot) == ("rate_limited", 2.0, 1002.0)
    assert _count(metrics, "late") == 1 and ex.backend.inspect("b") is None


def test_a_replay_spends_no_turn(gate: tuple[Executor, ManualClock, Metrics]) -> None:
    ex, _, _ = gate
    assert ex.run(_spec("a"), lambda _: 1).status == "ran"
    assert ex.run(_spec("a"), lambda _: 1).status == "replayed"  # the lease check came first
    assert ex.run(_spec("b"), lambda _: 1).countdown == pytest.approx(2.0)  # still one turn out


def test_skip_drops_the_job_and_says_so(gate: tuple[Executor, ManualClock, Metrics]) -> None:
    ex, _, metrics = gate
    ex.run(_spec("a", "skip"), lambda _: 1)
    out = ex.run(_spec("b", "skip"), lambda _: 1)
    assert out.status == "rate_skipped"
    assert out.value == {"jobfence": "rate_limited", "retry_after": 2.0}
    assert ex.backend.job_record("b") is None and ex.backend.inspect("b") is None
    assert json.dumps(out.value) and _count(metrics, "skip") == 1


def test_wait_blocks_up_to_wait_timeout_then_comes_back_for_its_turn(
    gate: tuple[Executor, ManualClock, Metrics],
) -> None:
    ex, clock, _ = gate
    for key in "abc":
        assert ex.run(_spec(key, "wait"), lambda _: 1).status == "ran"
    assert clock.now == pytest.approx(1004.0)  # b and c each waited 2 s in the worker
    far = ex.run(_spec("d", "wait", wait=1.0), lambda _: 1)  # 2 s away: over its 1 s
    assert far.status == "rate_limited" and ex.backend.inspect("d") is None
