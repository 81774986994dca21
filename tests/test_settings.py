"""Settings: every unsafe value is refused naming its JOBFENCE_ variable and a fix."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from jobfence.config import (
    InsecureSettingsWarning,
    JobfenceError,
    Settings,
    UnsafeSettings,
    load_settings,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No JOBFENCE_ variable from the caller's shell, and no .env file in reach."""
    for name in list(os.environ):
        if name.startswith("JOBFENCE_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


# (variable, environment value, keyword arguments): each alone is refused.
REFUSED: list[tuple[str, dict[str, str], dict[str, Any]]] = [
    ("JOBFENCE_DEFAULT_TTL", {"DEFAULT_TTL": "0"}, {"default_ttl": 0}),
    ("JOBFENCE_DEFAULT_TTL", {"DEFAULT_TTL": "-5"}, {"default_ttl": -5}),
    ("JOBFENCE_DEFAULT_TTL", {"DEFAULT_TTL": "soon"}, {"default_ttl": "soon"}),
    ("JOBFENCE_HEARTBEAT_FRACTION", {"HEARTBEAT_FRACTION": "0.5"}, {"heartbeat_fraction": 0.5}),
    ("JOBFENCE_HEARTBEAT_FRACTION", {"HEARTBEAT_FRACTION": "0.9"}, {"heartbeat_fraction": 0.9}),
    ("JOBFENCE_HEARTBEAT_FRACTION", {"HEARTBEAT_FRACTION": "0"}, {"heartbeat_fraction": 0}),
    ("JOBFENCE_ACQUIRE_TIMEOUT", {"ACQUIRE_TIMEOUT": "-1"}, {"acquire_timeout": -1}),
    ("JOBFENCE_BACKOFF_BASE", {"BACKOFF_BASE": "0"}, {"backoff_base": 0}),
    (
        "JOBFENCE_BACKOFF_BASE",
        {"BACKOFF_BASE": "1", "BACKOFF_CAP": "0.5"},
        {"backoff_base": 1, "backoff_cap": 0.5},
    ),
    ("JOBFENCE_SOCKET_TIMEOUT", {"SOCKET_TIMEOUT": "0"}, {"socket_timeout": 0}),
    (
        # TTL 3 s, heartbeat every 1 s: an extension hung for 2 s would outlive the lease.
        "JOBFENCE_SOCKET_TIMEOUT",
        {"DEFAULT_TTL": "3", "SOCKET_TIMEOUT": "2"},
        {"default_ttl": 3, "socket_timeout": 2},
    ),
    ("JOBFENCE_RESULT_TTL", {"RESULT_TTL": "0"}, {"result_ttl": 0}),
    ("JOBFENCE_FENCE_RETENTION", {"FENCE_RETENTION": "10"}, {"fence_retention": 10}),
    (
        "JOBFENCE_ACCEPT_CONTENT",
        {"ACCEPT_CONTENT": '["json", "pickle"]'},
        {"accept_content": ("json", "pickle")},
    ),
    ("JOBFENCE_ACCEPT_CONTENT", {"ACCEPT_CONTENT": '["yaml"]'}, {"accept_content": ("yaml",)}),
    (
        "JOBFENCE_VISIBILITY_TIMEOUT",
        {"VISIBILITY_TIMEOUT": "600", "MAX_COUNTDOWN": "3600"},
        {"visibility_timeout": 600, "max_countdown": 3600},
    ),
    (
        "JOBFENCE_VISIBILITY_TIMEOUT",
        {"VISIBILITY_TIMEOUT": "600", "MAX_COUNTDOWN": "600"},
        {"visibility_timeout": 600, "max_countdown": 600},
    ),
    ("JOBFENCE_KEY_PREFIX", {"KEY_PREFIX": "my app"}, {"key_prefix": "my app"}),
    ("JOBFENCE_KEY_PREFIX", {"KEY_PREFIX": "jf{x}"}, {"key_prefix": "jf{x}"}),
    ("JOBFENCE_KEY_PREFIX", {"KEY_PREFIX": ""}, {"key_prefix": ""}),
    ("JOBFENCE_LOCK_URL", {"LOCK_URL": "etcd://10.0.0.1:2379"}, {"lock_url": "etcd://h:2379"}),
    ("JOBFENCE_LOCK_URL", {"LOCK_URL": "127.0.0.1:6379"}, {"lock_url": "127.0.0.1:6379"}),
]
IDS = [f"{var}={env}" for var, env, _ in REFUSED]


def _assert_names_variable_and_fix(exc: UnsafeSettings, variable: str) -> None:
    assert exc.field == variable
    assert variable in str(exc)
    assert exc.problem and exc.fix
    assert f"Fix: {exc.fix}" in str(exc)
    assert isinstance(exc, ValueError) and isinstance(exc, JobfenceError)


@pytest.mark.parametrize(("variable", "env", "kwargs"), REFUSED, ids=IDS)
def test_refused_from_environment(
    monkeypatch: pytest.MonkeyPatch, variable: str, env: dict[str, str], kwargs: dict[str, Any]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(f"JOBFENCE_{name}", value)
    with pytest.raises(UnsafeSettings) as refused:
        load_settings()
    _assert_names_variable_and_fix(refused.value, variable)


@pytest.mark.parametrize(("variable", "env", "kwargs"), REFUSED, ids=IDS)
def test_refused_from_keywords(variable: str, env: dict[str, str], kwargs: dict[str, Any]) -> None:
    with pytest.raises(UnsafeSettings) as refused:
        load_settings(**kwargs)
    _assert_names_variable_and_fix(refused.value, variable)


def test_unsafe_settings_never_leave_a_pydantic_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBFENCE_ACCEPT_CONTENT", '["pickle"]')
    with pytest.raises(UnsafeSettings) as refused:
        load_settings()
    assert refused.value.__cause__ is None and refused.value.__context__ is None


def test_valid_defaults_load_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = load_settings()
    assert isinstance(s, Settings)
    assert s.lock_url == "redis://127.0.0.1:6379/0"
    assert s.default_ttl == 30.0
    assert s.heartbeat_interval == pytest.approx(10.0)
    assert s.heartbeat_interval < s.default_ttl / 2
    assert s.socket_timeout < s.default_ttl - s.heartbeat_interval
    assert s.accept_content == ("json",)
    assert s.key_prefix == "jobfence"


def test_environment_values_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBFENCE_DEFAULT_TTL", "12")
    monkeypatch.setenv("JOBFENCE_SOCKET_TIMEOUT", "0.5")
    monkeypatch.setenv("JOBFENCE_KEY_PREFIX", "shop")
    monkeypatch.setenv("JOBFENCE_LOCK_URL", "unix:///run/redis.sock")
    s = load_settings()
    assert (s.default_ttl, s.socket_timeout, s.key_prefix) == (12.0, 0.5, "shop")
    assert s.heartbeat_interval == pytest.approx(4.0)
    # Keywords win over the environment.
    assert load_settings(default_ttl=60).default_ttl == 60.0


def test_secret_is_not_shown() -> None:
    s = load_settings(key_secret="s3cr3t-value-123")
    assert "s3cr3t-value-123" not in repr(s)
    assert "s3cr3t-value-123" not in str(s.model_dump())
    assert s.secret_bytes() == b"s3cr3t-value-123"


@pytest.mark.parametrize(
    "url",
    ["redis://10.1.2.3:6379/0", "redis://redis.internal:6379/0", "redis://user@10.1.2.3:6379/0"],
)
def test_plain_redis_off_host_without_password_warns(url: str) -> None:
    with pytest.warns(InsecureSettingsWarning, match="JOBFENCE_LOCK_URL") as caught:
        load_settings(lock_url=url, key_secret="a-real-random-secret")
    assert len(caught) == 1


def test_insecure_url_warning_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBFENCE_LOCK_URL", "redis://10.9.8.7:6379/0")
    monkeypatch.setenv("JOBFENCE_KEY_SECRET", "a-real-random-secret")
    with pytest.warns(InsecureSettingsWarning, match="password"):
        load_settings()


def test_dev_secret_off_host_warns() -> None:
    with pytest.warns(InsecureSettingsWarning, match="JOBFENCE_KEY_SECRET"):
        load_settings(lock_url="rediss://:pw@10.1.2.3:6380/0")


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://localhost:6379/0",
        "redis://[::1]:6379/0",
        "redis://:pw@10.1.2.3:6379/0",
        "rediss://10.1.2.3:6380/0",
        "unix:///run/redis.sock",
    ],
)
def test_safe_urls_do_not_warn(url: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_settings(lock_url=url, key_secret="a-real-random-secret")


def test_settings_are_frozen() -> None:
    s = load_settings()
    with pytest.raises(Exception, match="frozen"):
        s.default_ttl = 1  # type: ignore[misc]
