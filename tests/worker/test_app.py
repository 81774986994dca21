"""create_app, the start-up checks (against real Redis servers) and the signal wiring."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery, signals

from jobfence.config import Settings, UnsafeSettings
from jobfence.config.errors import EX_CONFIG
from jobfence.locks import RedisBackend
from jobfence.tasks import runtime_for, singleton_task
from jobfence.worker.app import (
    BEAT_SCHEDULER,
    broker_urls,
    create_app,
    redis_db_url,
)
from jobfence.worker.checks import (
    StartupRefused,
    StartupWarning,
    enforce,
    lock_server_down,
    run_checks,
    watch_lock_server,
)
from tests.servers import RedisServer, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def _settings(lock_url: str, **overrides: object) -> Settings:
    return Settings(lock_url=lock_url, **overrides)  # type: ignore[arg-type]


@pytest.fixture
def make_app() -> Iterator[Callable[..., Celery]]:
    """Builds apps and closes their runtimes at teardown."""
    apps: list[Celery] = []

    def build(settings: Settings, **kwargs: object) -> Celery:
        app = create_app(settings, include=[], **kwargs)  # type: ignore[arg-type]
        apps.append(app)
        return app

    yield build
    for app in apps:
        runtime_for(app).close()


# --------------------------------------------------------------------------- create_app


def test_app_is_json_only_acks_late_with_the_visibility_timeout(make_app, redis_url):
    app = make_app(_settings(redis_url, visibility_timeout=120.0))
    conf = app.conf
    assert conf.accept_content == ["json"]
    assert conf.result_accept_content == ["json"]
    assert conf.task_serializer == conf.result_serializer == "json"
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    options = conf.broker_transport_options
    assert options["visibility_timeout"] == 120.0
    assert options["unacked_restore_throttle"] == 1
    assert options["unacked_restore_interval"] <= 10
    assert conf.beat_scheduler == BEAT_SCHEDULER


def test_broker_and_results_default_to_databases_1_and_2_of_the_lock_server(make_app):
    app = make_app(_settings("redis://:secret@127.0.0.1:7001/0"))
    assert app.conf.broker_url == "redis://:secret@127.0.0.1:7001/1"
    assert app.conf.result_backend == "redis://:secret@127.0.0.1:7001/2"


def test_explicit_broker_and_result_backend_win(make_app):
    settings = _settings(
        "redis://127.0.0.1:7001/0",
        broker_url="redis://127.0.0.1:7002/5",
        result_backend="redis://127.0.0.1:7003/6",
    )
    assert broker_urls(settings) == ("redis://127.0.0.1:7002/5", "redis://127.0.0.1:7003/6")


def test_redis_db_url_keeps_tls_options():
    assert redis_db_url("rediss://h:6380/0?ssl_cert_reqs=none", 2) == (
        "rediss://h:6380/2?ssl_cert_reqs=none"
    )


def test_a_unix_socket_lock_url_needs_an_explicit_broker():
    with pytest.raises(UnsafeSettings, match="JOBFENCE_BROKER_URL"):
        broker_urls(_settings("unix:///run/redis.sock?db=0"))


def test_creating_the_app_talks_to_no_server(make_app):
    closed = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens here
    app = make_app(_settings(closed))
    assert isinstance(runtime_for(app).backend, RedisBackend)


def test_an_app_holds_only_the_task_modules_and_schedule_its_caller_names(redis_url):
    """Issue 32, item 6: create_app() defaulted to the demo shop's task modules and its
    nightly reconciliation; a user's app now gets neither unless it names them."""
    app = create_app(_settings(redis_url))
    try:
        assert list(app.conf.include) == []
        assert app.conf.beat_schedule == {}
    finally:
        runtime_for(app).close()
    app = create_app(_settings(redis_url), include=["tests.worker.slot_app", "no.such.module"])
    try:  # a module that cannot be found is left out (with a warning), the rest kept
        assert list(app.conf.include) == ["tests.worker.slot_app"]
    finally:
        runtime_for(app).close()


# --------------------------------------------------------------------------- checks


def test_checks_pass_on_a_safe_setup(make_app, redis_url):
    app = make_app(_settings(redis_url))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert enforce(app, runtime_for(app)) == []


def test_checks_refuse_pickle(make_app, redis_url):
    app = make_app(_settings(redis_url))
    app.conf.accept_content = ["json", "pickle"]
    with pytest.raises(StartupRefused, match="pickle"):
        enforce(app, runtime_for(app))


def test_checks_refuse_a_lock_server_that_may_evict_keys(make_app, fresh_redis):
    fresh_redis.client().config_set("maxmemory-policy", "allkeys-lru")
    app = make_app(_settings(fresh_redis.url))
    with pytest.raises(StartupRefused, match="maxmemory-policy 'allkeys-lru'") as err:
        enforce(app, runtime_for(app))
    assert err.value.field == "JOBFENCE_LOCK_URL"
    assert "noeviction" in err.value.fix


def test_checks_warn_when_config_is_disabled(make_app):
    with RedisServer(extra_args=["--rename-command", "CONFIG", ""]) as server:
        app = make_app(_settings(server.url))
        with pytest.warns(StartupWarning, match="cannot read maxmemory-policy"):
            enforce(app, runtime_for(app))


def test_checks_warn_and_start_when_the_lock_server_is_unreachable(make_app):
    # A fleet restarted during a lock-server outage waits for it (fault row h), never
    # crash-loops: the finding is a warning that says so, not a refusal.
    app = make_app(_settings(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.5))
    with pytest.warns(StartupWarning, match="cannot reach the lock server.*starting anyway"):
        findings = enforce(app, runtime_for(app))
    assert lock_server_down(findings)


def test_a_lock_server_down_at_start_up_is_probed_until_it_answers_then_checked(
    make_app, caplog
):
    server = RedisServer(port=free_port(), extra_args=["--maxmemory-policy", "allkeys-lru"])
    app = make_app(_settings(server.db_url(0), socket_timeout=0.5))
    try:
        with caplog.at_level(logging.WARNING, logger="jobfence.worker.checks"):
            probe = watch_lock_server(runtime_for(app), cap=0.2)
            assert probe.is_alive()  # nothing answers yet: it keeps probing
            server.start()
            probe.join(timeout=60)
        assert not probe.is_alive()
    finally:
        server.stop()
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert any("answers again" in m for _, m in said), said
    # Too late to refuse the worker: the eviction policy it now finds is logged as an error.
    assert any(lvl == logging.ERROR and "maxmemory-policy 'allkeys-lru'" in m for lvl, m in said)


def test_checks_refuse_a_ttl_not_shorter_than_the_visibility_timeout(make_app, redis_url):
    app = make_app(_settings(redis_url, default_ttl=60.0, visibility_timeout=60.0))
    with pytest.raises(StartupRefused, match="not shorter than the broker's visibility") as err:
        enforce(app, runtime_for(app))
    assert err.value.field == "JOBFENCE_DEFAULT_TTL"


def test_checks_refuse_a_task_ttl_not_shorter_than_the_visibility_timeout(make_app, redis_url):
    app = make_app(_settings(redis_url, visibility_timeout=100.0))

    @singleton_task(app=app, name="long.job", ttl=100.0)
    def long_job() -> None: ...

    with pytest.raises(StartupRefused, match=r"task long\.job ttl"):
        enforce(app, runtime_for(app))


def test_checks_refuse_memory_locks_for_a_real_worker(make_app):
    app = make_app(_settings("memory://"))
    findings = run_checks(app, runtime_for(app))
    assert [f.setting for f in findings if f.refuse] == ["JOBFENCE_LOCK_URL"]
    app.conf.task_always_eager = True
    assert not [f for f in run_checks(app, runtime_for(app)) if f.refuse]


def test_checks_refuse_a_broker_that_may_evict_messages(make_app, redis_url):
    with RedisServer() as broker:
        broker.client().config_set("maxmemory-policy", "volatile-lru")
        app = make_app(_settings(redis_url, broker_url=broker.url))
        with pytest.raises(StartupRefused, match=r"broker .* maxmemory-policy 'volatile-lru'"):
            enforce(app, runtime_for(app))


@pytest.mark.parametrize("program", ["worker", "beat"])
def test_a_real_worker_or_beat_refuses_to_start_with_a_clear_message(fresh_redis, program):
    fresh_redis.client().config_set("maxmemory-policy", "allkeys-lru")
    env = {**os.environ, "JOBFENCE_LOCK_URL": fresh_redis.url}
    args = [sys.executable, "-m", "celery", "-A", "demo.app", program]
    if program == "worker":
        args += ["--pool", "solo"]
    done = subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == EX_CONFIG, output
    assert f"refusing to start the {program}" in output
    assert "maxmemory-policy 'allkeys-lru'" in output


# --------------------------------------------------------------------------- signals


def _keeping(app: Celery) -> bool:
    """Whether the app's keeper thread runs."""
    thread = runtime_for(app).keeper._thread
    return thread is not None and thread.is_alive()


def test_process_init_starts_the_keeper_and_shutdown_closes_the_runtime(make_app, redis_url):
    app = make_app(_settings(redis_url))
    assert not _keeping(app)
    signals.worker_process_init.send(sender="test@host")
    assert _keeping(app)
    signals.worker_process_shutdown.send(sender="test@host", pid=os.getpid(), exitcode=0)
    assert not _keeping(app)


def test_worker_shutdown_closes_only_its_own_apps_runtime(make_app, redis_url):
    mine, other = make_app(_settings(redis_url)), make_app(_settings(redis_url))
    for app in (mine, other):
        runtime_for(app).keeper.start()

    class FakeWorker:  # the signal's sender: only its `.app` is read
        app = mine

    signals.worker_shutdown.send(sender=FakeWorker())
    assert not _keeping(mine)
    assert _keeping(other)
