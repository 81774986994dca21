"""@singleton_task alone: the runtime is built from JOBFENCE_* on first use, once per app."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from jobfence.config import Settings, UnsafeSettings
from jobfence.tasks import Runtime, install, installed, runtime_for, singleton_task
from tests.tasks.conftest import AppFactory, unique


def _add(x: int, y: int = 0) -> int:
    return x + y


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> str:
    """JOBFENCE_* pointing at the private Redis, with a key prefix of this test's own."""
    prefix = unique("lazy")
    monkeypatch.setenv("JOBFENCE_LOCK_URL", redis_url)
    monkeypatch.setenv("JOBFENCE_KEY_PREFIX", prefix)
    return prefix


@pytest.fixture
def bare_app(make_app: AppFactory) -> Iterator[Any]:
    """Builds apps with no runtime installed; closes whatever runtime they built."""
    apps: list[Celery] = []

    def build(**options: Any) -> Celery:
        app = make_app(installed=False, **options)
        apps.append(app)
        return app

    yield build
    for app in apps:
        runtime = installed(app)
        if runtime is not None:
            runtime.close()


def test_decorating_builds_nothing(env: str, bare_app: Any) -> None:
    app = bare_app()
    singleton_task(app=app, name=unique("tests.lazy"), shared=False)(_add)
    assert installed(app) is None


def test_the_decorator_alone_runs_a_task_from_the_environment(
    env: str, bare_app: Any, redis_client: redis.Redis
) -> None:
    app = bare_app()
    task = singleton_task(app=app, name=unique("tests.lazy"), shared=False)(_add)
    assert task.delay(2, 3).get() == 5
    runtime = installed(app)
    assert runtime is not None
    assert runtime.settings.key_prefix == env
    assert redis_client.keys(f"{env}*"), "the job's keys live under the environment's prefix"
    assert task.delay(2, 3).get() == 5  # the stored result: the same runtime, the same record


def test_publishing_alone_builds_the_runtime(
    env: str, bare_app: Any, redis_client: redis.Redis
) -> None:
    app = bare_app(eager=False)
    task = singleton_task(app=app, name=unique("tests.lazy"), shared=False)(_add)
    task.apply_async((1,), idempotency_key="order-1")
    message = json.loads(redis_client.lindex("celery", 0) or b"{}")
    assert message["headers"]["jobfence_idempotency_key"] == "order-1"
    assert installed(app) is not None


def test_threads_racing_for_the_runtime_get_one(env: str, bare_app: Any) -> None:
    app = bare_app()
    start = threading.Barrier(16)
    got: list[Runtime] = []

    def first_use() -> None:
        start.wait()
        got.append(runtime_for(app))

    threads = [threading.Thread(target=first_use) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(got) == 16
    assert {id(r) for r in got} == {id(installed(app))}


def test_each_app_gets_its_own_runtime(env: str, bare_app: Any) -> None:
    one, two = bare_app(), bare_app()
    assert runtime_for(one) is runtime_for(one)
    assert runtime_for(one) is not runtime_for(two)


def test_an_installed_runtime_wins_over_the_environment(
    env: str, bare_app: Any, redis_url: str
) -> None:
    app = bare_app()
    runtime = install(app, Settings(lock_url=redis_url, key_prefix="installed"))
    assert runtime_for(app) is runtime


def test_an_unusable_environment_is_named_at_first_use(
    env: str, bare_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBFENCE_DEFAULT_TTL", "-1")
    app = bare_app()
    task = singleton_task(app=app, name=unique("tests.lazy"), shared=False)(_add)
    with pytest.raises(UnsafeSettings, match="JOBFENCE_DEFAULT_TTL"):
        task.delay(1)
    assert installed(app) is None
