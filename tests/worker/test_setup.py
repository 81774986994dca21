"""jobfence.setup(app) on a user's own Celery app: safe configuration, checks, signals, beat."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, signals

import jobfence
from jobfence.config import Settings, UnsafeSettings
from jobfence.tasks import installed, runtime_for, singleton_task
from jobfence.worker.app import create_app, redis_db_url
from jobfence.worker.checks import StartupRefused, StartupWarning, enforce
from jobfence.worker.setup import BEAT_SCHEDULER, is_set_up, safe_config

USER_BROKER = "redis://127.0.0.1:7009/4"  # never contacted: nothing here talks to a broker


@pytest.fixture
def user_app(redis_url: str) -> Iterator[Callable[..., Celery]]:
    """Builds a user's own Celery apps (broker and results on the private Redis, databases 4
    and 5); closes whatever runtime they got."""
    apps: list[Celery] = []

    def build(**conf: Any) -> Celery:
        broker, backend = redis_db_url(redis_url, 4), redis_db_url(redis_url, 5)
        app = Celery("userproj", broker=broker, backend=backend, set_as_current=False)
        if conf:
            app.conf.update(conf)
        apps.append(app)
        return app

    yield build
    for app in apps:
        runtime = installed(app)
        if runtime is not None:
            runtime.close()


def test_setup_gives_the_app_the_bundled_apps_safe_configuration(user_app, redis_url):
    app = user_app()
    runtime = jobfence.setup(app, Settings(lock_url=redis_url, visibility_timeout=120.0))
    conf = app.conf
    assert conf.accept_content == ["json"]
    assert conf.result_accept_content == ["json"]
    assert conf.task_serializer == conf.result_serializer == conf.event_serializer == "json"
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == 120.0
    assert conf.broker_transport_options["unacked_restore_throttle"] == 1
    assert conf.beat_scheduler == BEAT_SCHEDULER
    assert runtime_for(app) is runtime
    assert is_set_up(app)


def test_the_broker_and_result_backend_stay_the_apps_own(user_app, redis_url):
    app = user_app()
    jobfence.setup(app, Settings(lock_url=redis_url))
    assert app.conf.broker_url == redis_db_url(redis_url, 4)
    assert app.conf.result_backend == redis_db_url(redis_url, 5)


def test_the_bundled_app_gets_the_same_configuration_from_the_same_code(user_app, redis_url):
    settings = Settings(lock_url=redis_url, visibility_timeout=300.0)
    mine = user_app()
    jobfence.setup(mine, settings)
    bundled = create_app(settings, include=[])
    try:
        for key, value in safe_config(settings).items():
            assert bundled.conf[key] == mine.conf[key] == value, key
    finally:
        runtime_for(bundled).close()


def test_a_conflicting_value_is_kept_reported_and_refused_at_start(user_app, redis_url, caplog):
    app = user_app(accept_content=["pickle", "json"])
    with caplog.at_level(logging.WARNING, logger="jobfence.worker.setup"):
        runtime = jobfence.setup(app, Settings(lock_url=redis_url))
        assert app.conf.accept_content == ["pickle", "json"]  # never silently replaced
    assert "accept_content=['pickle', 'json']" in caplog.text
    with pytest.raises(StartupRefused, match="accept_content") as refused:
        enforce(app, runtime)
    assert "pickle" in str(refused.value)


def test_the_apps_transport_options_are_merged_over_jobfences(user_app, redis_url):
    app = user_app(broker_transport_options={"visibility_timeout": 7200, "max_retries": 3})
    jobfence.setup(app, Settings(lock_url=redis_url))
    options = app.conf.broker_transport_options
    assert options["visibility_timeout"] == 7200  # the app's own value
    assert options["max_retries"] == 3
    assert options["unacked_restore_throttle"] == 1  # jobfence's where the app said nothing


def test_a_visibility_timeout_the_app_set_too_short_is_refused(user_app, redis_url):
    app = user_app(broker_transport_options={"visibility_timeout": 20})
    runtime = jobfence.setup(app, Settings(lock_url=redis_url, default_ttl=30.0))
    with pytest.raises(StartupRefused, match="visibility timeout"), pytest.warns(StartupWarning):
        enforce(app, runtime)


def test_an_app_visibility_timeout_below_jobfences_is_warned(user_app, redis_url):
    app = user_app(broker_transport_options={"visibility_timeout": 600})
    runtime = jobfence.setup(app, Settings(lock_url=redis_url, visibility_timeout=3600.0))
    with pytest.warns(StartupWarning, match="JOBFENCE_VISIBILITY_TIMEOUT=600"):
        assert not [f for f in enforce(app, runtime) if f.refuse]


def test_configuration_loaded_after_setup_is_filled_in_too(redis_url):
    class DjangoSettings:  # as `config_from_object("django.conf:settings", namespace="CELERY")`
        CELERY_BROKER_URL = USER_BROKER
        CELERY_TASK_ACKS_LATE = False

    app = Celery("django_proj", set_as_current=False)
    runtime = jobfence.setup(app, Settings(lock_url=redis_url))
    try:
        app.config_from_object(DjangoSettings, namespace="CELERY")
        assert app.conf.broker_url == USER_BROKER
        assert app.conf.task_acks_late is False  # the project's own choice, kept
        assert app.conf.accept_content == ["json"]
        assert app.conf.worker_prefetch_multiplier == 1
    finally:
        runtime.close()


def test_setup_without_settings_reads_the_environment(user_app, redis_url, monkeypatch):
    monkeypatch.setenv("JOBFENCE_LOCK_URL", redis_url)
    monkeypatch.setenv("JOBFENCE_DEFAULT_TTL", "12")
    app = user_app()
    assert jobfence.setup(app).settings.default_ttl == 12.0


def test_setup_defers_an_unusable_variable_to_each_use_and_the_workers_start(
    user_app, monkeypatch, capsys
):
    """An import must not fail (a Django project imports its Celery app in every manage.py
    command); every use, and a worker's start, names the variable."""
    from jobfence.config.errors import EX_CONFIG
    from jobfence.worker.checks import enforce_or_exit
    from jobfence.worker.setup import is_set_up, unsettled

    monkeypatch.setenv("JOBFENCE_HEARTBEAT_FRACTION", "0.9")
    app = user_app()
    runtime = jobfence.setup(app)
    assert is_set_up(app) and isinstance(unsettled(app), UnsafeSettings)
    with pytest.raises(UnsafeSettings, match="JOBFENCE_HEARTBEAT_FRACTION"):
        runtime.settings  # noqa: B018
    with pytest.raises(SystemExit) as exited:
        enforce_or_exit(app, runtime, "worker")
    assert exited.value.code == EX_CONFIG
    assert "JOBFENCE_HEARTBEAT_FRACTION" in capsys.readouterr().err


def test_setup_with_explicit_settings_still_raises(user_app):
    with pytest.raises(UnsafeSettings, match="JOBFENCE_HEARTBEAT_FRACTION"):
        jobfence.setup(user_app(), Settings(heartbeat_fraction=0.9))


def test_setup_twice_is_one_setup(user_app, redis_url):
    app = user_app()
    settings = Settings(lock_url=redis_url)
    runtime = jobfence.setup(app, settings)
    assert jobfence.setup(app) is runtime
    assert jobfence.setup(app, settings) is runtime
    with pytest.raises(ValueError, match="already set up with other settings"):
        jobfence.setup(app, Settings(lock_url=redis_url, default_ttl=10.0))


def test_setup_keeps_a_runtime_installed_before(user_app, redis_url):
    app = user_app()
    runtime = jobfence.install(app, Settings(lock_url=redis_url))
    assert jobfence.setup(app) is runtime


def test_setup_wires_the_keeper_into_the_worker_life_cycle(user_app, redis_url):
    app = user_app()
    runtime = jobfence.setup(app, Settings(lock_url=redis_url))

    @singleton_task(app=app, name="userproj.job")
    def job() -> None: ...

    def keeping() -> bool:
        thread = runtime.keeper._thread
        return thread is not None and thread.is_alive()

    assert not keeping()
    signals.worker_process_init.send(sender="test@host")
    assert keeping()
    signals.worker_process_shutdown.send(sender="test@host", pid=os.getpid(), exitcode=0)
    assert not keeping()
