"""Settings: every unsafe value is refused naming its JOBFENCE_ variable and a fix."""

from __future__ import annotations

import os
import string
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobfence.config import (
    InsecureSettingsWarning,
    JobfenceError,
    Settings,
    UnsafeSettings,
    load_settings,
    redact,
)
from jobfence.config.settings import known_variables, unknown_variables


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
    ("JOBFENCE_LOCK_URL", {"LOCK_URL": "consul://10.0.0.1:8500"}, {"lock_url": "consul://h:8500"}),
    ("JOBFENCE_LOCK_URL", {"LOCK_URL": "127.0.0.1:6379"}, {"lock_url": "127.0.0.1:6379"}),
    ("JOBFENCE_LOCK_URL", {"LOCK_URL": "redis://h:99999"}, {"lock_url": "redis://h:99999"}),
    ("JOBFENCE_LOCK_URL", {"LOCK_URL": "redis://h:abc/0"}, {"lock_url": "redis://h:abc/0"}),
    ("JOBFENCE_LOCK_URL", {"LOCK_URL": "redis://h:6379/x"}, {"lock_url": "redis://h:6379/x"}),
    ("JOBFENCE_LOCK_URL", {"LOCK_URL": "redis://:6379/0"}, {"lock_url": "redis://:6379/0"}),
    ("JOBFENCE_BROKER_URL", {"BROKER_URL": "127.0.0.1:5672"}, {"broker_url": "h:5672"}),
    ("JOBFENCE_BROKER_URL", {"BROKER_URL": "amqp://h:0//"}, {"broker_url": "amqp://h:0//"}),
    ("JOBFENCE_RESULT_BACKEND", {"RESULT_BACKEND": "redis://h:x"}, {"result_backend": "redis://h:x"}),
    (
        "JOBFENCE_DATABASE_URL",
        {"DATABASE_URL": "postgresql://u:pw@h:54x2/db"},
        {"database_url": "postgresql://u:pw@h:54x2/db"},
    ),
    ("JOBFENCE_ACCEPT_CONTENT", {"ACCEPT_CONTENT": "json,pickle"}, {"accept_content": "pickle"}),
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
        load_settings(lock_url=url, key_secret="a-real-random-secret-0123456789abcdef")
    assert len(caught) == 1


def test_insecure_url_warning_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBFENCE_LOCK_URL", "redis://10.9.8.7:6379/0")
    monkeypatch.setenv("JOBFENCE_KEY_SECRET", "a-real-random-secret-0123456789abcdef")
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
        "rediss://:pw@10.1.2.3:6380/0",
        "rediss://10.1.2.3:6380/0?ssl_certfile=/etc/c.pem&ssl_keyfile=/etc/k.pem",
        "postgresql://u:pw@10.1.2.3/db?sslmode=verify-full",
        "unix:///run/redis.sock",
    ],
)
def test_safe_urls_do_not_warn(url: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_settings(lock_url=url, key_secret="a-real-random-secret-0123456789abcdef")


def test_settings_are_frozen() -> None:
    s = load_settings()
    with pytest.raises(Exception, match="frozen"):
        s.default_ttl = 1  # type: ignore[misc]


# -- errors a person can act on, with no secret in them ---------------------------------

SECRET = "s3cr3t-Key-Value-0042"
PASSWORD = "hunter2-Pa55"

# Invalid settings next to a real secret and passwords: (environment, variable refused).
INVALID_BESIDE_SECRETS: list[tuple[dict[str, str], str]] = [
    ({"DEFAULT_TTL": "soon"}, "JOBFENCE_DEFAULT_TTL"),
    ({"DEFAULT_TTL": "0"}, "JOBFENCE_DEFAULT_TTL"),
    ({"HEARTBEAT_FRACTION": "0.9"}, "JOBFENCE_HEARTBEAT_FRACTION"),
    ({"LOCK_URL": f"redis://:{PASSWORD}@10.0.0.1:99999/0"}, "JOBFENCE_LOCK_URL"),
    ({"LOCK_URL": f"etcd://10.0.0.1:2379?password={PASSWORD}"}, "JOBFENCE_LOCK_URL"),
    ({"LOCK_URL": f"etcd://root:{PASSWORD}@10.0.0.1:2379?cacert=/ca.pem"}, "JOBFENCE_LOCK_URL"),
    ({"LOCK_URL": f"default:{PASSWORD}@10.0.0.1:6379"}, "JOBFENCE_LOCK_URL"),
    ({"DATABASE_URL": f"postgresql://app:{PASSWORD}@db:5x/shop"}, "JOBFENCE_DATABASE_URL"),
    ({"BROKER_URL": f"amqp://app:{PASSWORD}@mq:70000//"}, "JOBFENCE_BROKER_URL"),
    ({"KEY_PREFIX": "my app"}, "JOBFENCE_KEY_PREFIX"),
    ({"LOCK_URL": f"redis://:{PASSWORD}#x@10.0.0.1:6379/0"}, "JOBFENCE_LOCK_URL"),
    ({"LOCK_URL": f"redis://:{PASSWORD}/x@10.0.0.1:6379/0"}, "JOBFENCE_LOCK_URL"),
]


def _everything_shown(exc: BaseException) -> str:
    """What a log line, a traceback or a debugger's repr could show of `exc`."""
    return "\n".join([str(exc), repr(exc), *traceback.format_exception(exc)])


@pytest.mark.parametrize(("env", "variable"), INVALID_BESIDE_SECRETS, ids=lambda v: str(v))
def test_settings_and_load_settings_refuse_alike_without_secrets(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], variable: str
) -> None:
    monkeypatch.setenv("JOBFENCE_KEY_SECRET", SECRET)
    monkeypatch.setenv("JOBFENCE_RESULT_BACKEND", f"redis://:{PASSWORD}@127.0.0.1:6379/2")
    for name, value in env.items():
        monkeypatch.setenv(f"JOBFENCE_{name}", value)
    shown = []
    for build in (Settings, load_settings):  # Settings() as the README shows it
        with pytest.raises(UnsafeSettings) as refused:
            build()
        _assert_names_variable_and_fix(refused.value, variable)
        text = _everything_shown(refused.value)
        assert SECRET not in text and PASSWORD not in text
        assert "input_value" not in text and "ValidationError" not in text
        shown.append(str(refused.value))
    assert shown[0] == shown[1]


def test_keyword_secrets_stay_out_of_errors_too() -> None:
    with pytest.raises(UnsafeSettings) as refused:
        Settings(key_secret=SECRET, default_ttl="soon", lock_url=f"redis://:{PASSWORD}@h:1/0")
    text = _everything_shown(refused.value)
    assert SECRET not in text and PASSWORD not in text


def test_every_problem_is_listed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBFENCE_DEFAULT_TTL", "soon")
    monkeypatch.setenv("JOBFENCE_LOCK_URL", "127.0.0.1:6379")
    with pytest.raises(UnsafeSettings) as refused:
        Settings()
    assert {refused.value.field, *(o.field for o in refused.value.also)} == {
        "JOBFENCE_DEFAULT_TTL",
        "JOBFENCE_LOCK_URL",
    }
    text = str(refused.value)
    assert "JOBFENCE_DEFAULT_TTL" in text and "JOBFENCE_LOCK_URL" in text


def test_repr_and_str_hide_url_passwords_and_the_secret() -> None:
    s = load_settings(
        key_secret=SECRET,
        lock_url=f"rediss://default:{PASSWORD}@10.1.2.3:6380/0",
        broker_url=f"amqp://app:{PASSWORD}@mq:5672//",
        result_backend=f"redis://:{PASSWORD}@10.1.2.3:6379/2",
        database_url=f"postgresql+psycopg://app:{PASSWORD}@db:5432/shop",
    )
    for text in (repr(s), str(s)):
        assert SECRET not in text and PASSWORD not in text
        assert "rediss://default:***@10.1.2.3:6380/0" in text
        assert "postgresql+psycopg://app:***@db:5432/shop" in text
    assert s.lock_url.endswith(f"{PASSWORD}@10.1.2.3:6380/0")  # the value itself is intact


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://h:99999", "port 99999"),
        ("redis://h:abc", "port 'abc'"),
        ("127.0.0.1:6379", "no scheme"),
        ("localhost:6379", "no scheme"),
        ("consul://h:8500", "scheme 'consul'"),
        ("redis://h:6379/zero", "database 'zero'"),
        ("unix://", "no socket path"),
    ],
)
def test_a_bad_lock_url_is_one_line_with_an_example(url: str, problem: str) -> None:
    with pytest.raises(UnsafeSettings) as refused:
        Settings(lock_url=url)
    text = str(refused.value)
    assert "\n" not in text
    assert text.startswith("JOBFENCE_LOCK_URL: ") and problem in text
    assert "such as redis://" in text or "such as unix://" in text


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://[::1]:6379",
        "rediss://user:p%40ss@h:6380/0?ssl_ca_certs=/etc/ca.pem",
        "unix:///run/redis.sock?db=1",
        "memory://",
        "redis://localhost",
    ],
)
def test_good_lock_urls_pass(url: str) -> None:
    secret = "a-real-random-secret-0123456789abcdef"
    assert load_settings(lock_url=url, key_secret=secret).lock_url == url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:pw@h:6379/0", "redis://user:***@h:6379/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://user@h:6379/0", "redis://user@h:6379/0"),
        ("amqp://u:p/w@d@mq:99999//", "amqp://u:***@mq:99999//"),  # invalid, still redacted
        ("u:pw@h:6379", "u:***@h:6379"),  # no scheme
        ("redis://h:6379/0?password=pw&db=1", "redis://h:6379/0?password=***&db=1"),
        ("redis://:pw#1@h/0", "redis://:***@h/0"),
        ("redis://h/0?user=a@b.example", "redis://h/0?user=a@b.example"),
    ],
)
def test_redact_hides_passwords_even_in_broken_urls(url: str, shown: str) -> None:
    assert redact(url) == shown


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("json", ("json",)),
        ("json,application/json", ("json", "application/json")),
        (" json , application/json ", ("json", "application/json")),
        ('["json"]', ("json",)),
    ],
)
def test_accept_content_takes_a_word_or_a_comma_list(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: tuple[str, ...]
) -> None:
    monkeypatch.setenv("JOBFENCE_ACCEPT_CONTENT", value)
    assert Settings().accept_content == expected


# -- unknown JOBFENCE_* variables ---------------------------------------------------------


def test_a_typo_is_reported_with_the_closest_name() -> None:
    env = {
        "JOBFENCE_DEFAULT_TLL": "5",
        "JOBFENCE_LOCK_URL": "redis://127.0.0.1:6379/0",
        "JOBFENCE_ZZZ_WHATEVER": "1",
        "PATH": "/bin",
    }
    assert unknown_variables(env) == [
        ("JOBFENCE_DEFAULT_TLL", "JOBFENCE_DEFAULT_TTL"),
        ("JOBFENCE_ZZZ_WHATEVER", None),
    ]


def test_variables_jobfence_reads_elsewhere_are_known() -> None:
    from demo.journal import JOURNAL_ENV
    from demo.shop.faults import ENV_PREFIX as DEMO_PREFIX
    from demo.shop.faults import DemoFaults
    from devstack.bench.celery_bench_app import URL_ENV

    read_elsewhere = {DEMO_PREFIX + f.upper() for f in DemoFaults.model_fields}
    read_elsewhere |= {JOURNAL_ENV, URL_ENV, "JOBFENCE_DASHBOARD_TOKEN"}  # the dashboard's login
    assert read_elsewhere <= known_variables()
    assert unknown_variables(dict.fromkeys(read_elsewhere, "1")) == []
    assert unknown_variables({f"JOBFENCE_{f.upper()}": "1" for f in Settings.model_fields}) == []


def test_the_environment_and_the_env_file_are_both_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / ".env").write_text("JOBFENCE_KEY_SECRT=abc\nOTHER=1\n")
    monkeypatch.setenv("jobfence_default_ttl", "12")  # pydantic reads names in any case
    monkeypatch.setenv("JOBFENCE_SOCKET_TIMEOT", "1")
    assert unknown_variables() == [
        ("JOBFENCE_KEY_SECRT", "JOBFENCE_KEY_SECRET"),
        ("JOBFENCE_SOCKET_TIMEOT", "JOBFENCE_SOCKET_TIMEOUT"),
    ]


@given(
    scheme=st.sampled_from(["redis", "rediss", "amqp", "postgresql+psycopg", ""]),
    user=st.text(alphabet="abcxyz-_.", max_size=8),
    password=st.text(alphabet=string.ascii_letters + string.digits + "/@:#%!", min_size=6),
    tail=st.sampled_from(["h:6379/0", "h:99999/x", "[::1]:6379", "h", "h/0?db=1"]),
)
def test_redact_never_fails_and_never_shows_the_password(
    scheme: str, user: str, password: str, tail: str
) -> None:
    head = f"{scheme}://" * bool(scheme)
    assert redact(f"{head}{user}:{password}@{tail}") == f"{head}{user}:***@{tail}"


# Every float field, found from the model, so a field added later is covered without a list.
FLOAT_FIELDS = sorted(
    name
    for name, info in Settings.model_fields.items()
    if info.annotation in (float, float | None)
)
NON_FINITE = ("nan", "inf", "-inf")


def test_float_fields_are_found() -> None:
    assert {"default_ttl", "result_ttl", "visibility_timeout"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("text", NON_FINITE)
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_float_from_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, field: str, text: str
) -> None:
    variable = f"JOBFENCE_{field.upper()}"
    monkeypatch.setenv(variable, text)
    with pytest.raises(UnsafeSettings) as info:
        Settings()
    assert info.value.field == variable
    assert "finite number" in str(info.value) and f"set {variable}" in str(info.value)


@pytest.mark.parametrize("text", NON_FINITE)
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_float_argument_is_refused(field: str, text: str) -> None:
    with pytest.raises(UnsafeSettings) as info:
        Settings(**{field: float(text)})
    assert info.value.field == f"JOBFENCE_{field.upper()}"
    assert "finite number" in str(info.value)
