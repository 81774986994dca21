"""NaN and infinity are refused wherever jobfence reads a number: options, Locker, CLI."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest

from demo.fleet import build_parser as fleet_parser
from jobfence.config import UnsafeSettings
from jobfence.locks import (
    Backoff,
    LeaderElector,
    LeaseKeeper,
    Locker,
    LockError,
    MemoryBackend,
    acquire,
)
from jobfence.locks.ratelimit import Rate, RateLimiter
from jobfence.tasks import TaskDefinitionError, runtime_for, singleton_task
from tests.tasks.conftest import AppFactory, unique

NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("option", ["ttl", "wait_timeout", "result_ttl", "unique_for"])
def test_decorator_refuses_a_non_finite_option(option: str, value: float) -> None:
    with pytest.raises(TaskDefinitionError) as refused:
        singleton_task(**{option: value})
    assert str(refused.value).startswith(f"{option} must be ")
    assert "finite" in str(refused.value) or value < 0


def test_decorator_still_takes_finite_options() -> None:
    singleton_task(ttl=30, wait_timeout=0, result_ttl=3600.5, unique_for=1)


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("argument", ["ttl", "timeout"])
def test_locker_refuses_a_non_finite_default(argument: str, value: float) -> None:
    with pytest.raises(LockError, match=f"Locker {argument} must be"):
        Locker(MemoryBackend(), **{argument: value})


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
def test_locker_calls_refuse_a_non_finite_ttl(value: float) -> None:
    locker = Locker(MemoryBackend())
    with pytest.raises(LockError, match="ttl must be"):
        locker.acquire(unique("k"), ttl=value)
    with pytest.raises(LockError, match="ttl must be"):
        locker.acquire_slot(unique("k"), limit=1, ttl=value)


def test_a_nan_timeout_is_refused_instead_of_waiting_for_ever() -> None:
    locker = Locker(MemoryBackend())
    key = unique("k")
    held = locker.acquire(key)
    try:
        with pytest.raises(LockError, match="timeout must be a finite number"):
            locker.acquire(key, timeout=math.nan)
        with pytest.raises(LockError, match="timeout must be a finite number"):
            locker.acquire_slot(key + "-slots", limit=1, timeout=math.nan)
        with pytest.raises(LockError, match="timeout must be a finite number"):
            acquire(locker.backend, key, ttl=5, timeout=math.nan)
    finally:
        locker.release(held)
        locker.keeper.stop()


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
def test_rate_limiter_and_elector_refuse_non_finite_numbers(value: float) -> None:
    backend = MemoryBackend()
    with pytest.raises(LockError, match="timeout must be"):
        RateLimiter(backend, unique("r"), "10/s", timeout=value)
    with pytest.raises(LockError, match="ttl must be"):
        LeaderElector(backend, LeaseKeeper(), unique("l"), ttl=value)
    with pytest.raises(LockError, match="backoff"):
        Backoff(0.005 if value > 0 else value, value)
    with pytest.raises(LockError, match="rate needs"):
        Rate(value, 1.0)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "0"])
def test_cli_refuses_a_non_finite_shutdown_timeout(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        fleet_parser().parse_args([f"--shutdown-timeout={text}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--shutdown-timeout" in err and "finite number of seconds" in err


def _runs_of_two_calls(app: Any) -> list[int]:
    """Call one job twice (as two deliveries would); the body's runs."""
    runs: list[int] = []

    def charge(payment_id: int) -> int:
        runs.append(payment_id)
        return payment_id

    task = singleton_task(app=app, shared=False, name=unique("tests.charge"))(charge)
    for _ in range(2):
        with contextlib.suppress(Exception):  # on main the commit raises OverflowError
            task.delay(7)
    return runs


def test_an_infinite_result_ttl_is_refused_before_any_body_runs(
    make_app: AppFactory, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    # Before the fix the body ran, the commit overflowed, no record was kept: twice.
    monkeypatch.setenv("JOBFENCE_LOCK_URL", redis_url)
    monkeypatch.setenv("JOBFENCE_RESULT_TTL", "inf")
    app = make_app(installed=False)
    assert _runs_of_two_calls(app) == []
    with pytest.raises(UnsafeSettings, match="JOBFENCE_RESULT_TTL: must be a finite number"):
        runtime_for(app)


def test_control_a_finite_result_ttl_runs_the_body_once(
    make_app: AppFactory, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    monkeypatch.setenv("JOBFENCE_LOCK_URL", redis_url)
    monkeypatch.setenv("JOBFENCE_RESULT_TTL", "600")
    app = make_app(installed=False)
    assert _runs_of_two_calls(app) == [7]
    runtime_for(app).close()
