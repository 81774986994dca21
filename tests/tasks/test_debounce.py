"""Debounce (issue 34, item 2): a burst of publishes of one key runs once, with the latest
arguments, after the quiet period, and never later than `debounce_max_wait` after the burst's
first publish; every other copy ends JobSuperseded naming the run that stands for it. On a
real worker (Celery's threads pool), a private redis-server broker and lock server."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from jobfence.config import Settings
from jobfence.tasks import JobSuperseded, TaskDefinitionError, install, singleton_task
from tests.servers import RedisServer, wait_for

QUIET = 0.6


@pytest.fixture
def app(fresh_redis: RedisServer) -> Iterator[Celery]:
    app = Celery("debounce-test", set_as_current=False)
    app.conf.update(broker_url=fresh_redis.db_url(0), result_backend=fresh_redis.db_url(1),
                    task_serializer="json", accept_content=["json"],
                    result_accept_content=["json"])  # fmt: skip
    settings = Settings(lock_url=fresh_redis.db_url(2), key_prefix="db",
                        key_secret="debounce-test-secret-not-for-production")  # fmt: skip
    runtime = install(app, settings)
    yield app
    runtime.close()


def _task(app: Celery, runs: list[tuple[str, float]], **options: Any) -> Any:
    options.setdefault("key", ["user"])

    @singleton_task(app=app, name=f"debounce.sync.{uuid.uuid4().hex[:8]}", **options)
    def sync(user: str, version: str) -> str:
        runs.append((version, time.monotonic()))
        return version

    return sync


def test_a_burst_runs_once_with_the_latest_arguments_after_the_quiet_period(app: Celery) -> None:
    runs: list[tuple[str, float]] = []
    sync = _task(app, runs, debounce=QUIET)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                      loglevel="WARNING"):
        copies = []
        for i in range(5):
            if copies:
                time.sleep(0.1)
            copies.append(sync.delay("u1", f"v{i}"))
        last_publish = time.monotonic()
        assert copies[-1].get(timeout=10) == "v4"
        for earlier in copies[:-1]:
            with pytest.raises(JobSuperseded) as stop:
                earlier.get(timeout=10)
            assert stop.value.task_id == copies[-1].id  # the run that stands for it
    assert [v for v, _ in runs] == ["v4"]
    assert runs[0][1] - last_publish >= QUIET * 0.9, "ran before the quiet period"


def test_control_without_debounce_each_publish_runs(app: Celery) -> None:
    runs: list[tuple[str, float]] = []
    sync = _task(app, runs, key=None)  # each publish a job of its own, as a plain task's
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                      loglevel="WARNING"):
        copies = [sync.delay("u1", f"v{i}") for i in range(5)]
        for c in copies:
            c.get(timeout=10)
    assert len(runs) == 5


def test_a_burst_that_never_goes_quiet_runs_by_its_max_wait(app: Celery) -> None:
    runs: list[tuple[str, float]] = []
    sync = _task(app, runs, debounce=QUIET, debounce_max_wait=1.2)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                      loglevel="WARNING"):
        first = time.monotonic()
        published = []
        while time.monotonic() - first < 2.6:  # a publish every 0.15 s: never quiet
            published.append(sync.delay("u1", f"v{len(published)}"))
            time.sleep(0.15)
        published[-1].get(timeout=10)
        wait_for(lambda: all(r.ready() for r in published), 10.0,
                 message=lambda: str([(i, r.state) for i, r in enumerate(published)
                                      if not r.ready()]))  # fmt: skip
    assert len(runs) >= 2, "a never-quiet burst waited past its max wait"
    # Without the bound the burst runs once, after it ends (2.6 s in): the bound runs it early.
    assert runs[0][1] - first <= 1.2 + 1.2, f"the first run came {runs[0][1] - first:.2f}s in"
    assert runs[-1][0] == f"v{len(published) - 1}", "the last publish did not run"
    assert len(runs) < len(published) / 3


def test_a_publish_during_the_run_starts_the_next_burst(app: Celery) -> None:
    runs: list[tuple[str, float]] = []
    gate = threading.Event()

    @singleton_task(app=app, name=f"debounce.slow.{uuid.uuid4().hex[:8]}", key=["user"],
                    debounce=0.2)  # fmt: skip
    def slow(user: str, version: str) -> str:
        runs.append((version, time.monotonic()))
        gate.wait(10)
        return version

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                      loglevel="WARNING"):
        first = slow.delay("u1", "a")
        wait_for(lambda: len(runs) == 1, 10.0)
        second = slow.delay("u1", "b")  # during the run: not replaced into it, queued
        time.sleep(0.5)
        gate.set()
        assert (first.get(timeout=10), second.get(timeout=10)) == ("a", "b")
    assert [v for v, _ in runs] == ["a", "b"]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"debounce_max_wait": 5}, "set debounce"),
        ({"debounce": 5, "debounce_max_wait": 1}, "at least debounce"),
        ({"debounce": 5, "unique_for": 10}, "unique_for"),
        ({"debounce": 5, "dedupe_on_publish": True, "on_duplicate_publish": "raise"},
         "on_duplicate_publish"),
        ({"debounce": 5, "on_conflict": "raise"}, "on_conflict"),
        ({"debounce": 0}, "positive seconds"),
    ],
)
def test_options_against_debounce_are_refused_naming_them(
    app: Celery, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(TaskDefinitionError, match=named):
        _task(app, [], **options)


def test_debounce_sets_what_it_needs(app: Celery) -> None:
    o = _task(app, [], debounce=1).jobfence_options
    assert (o.dedupe_on_publish, o.on_duplicate_publish, o.lock_until, o.on_conflict) == (
        True, "replace", "start", "wait"
    )  # fmt: skip
