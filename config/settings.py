"""Typed, validated settings for jobfence, read from JOBFENCE_* environment variables."""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

import jobfence.config.security as security
from jobfence.config.django_source import django_settings, django_sources
from jobfence.config.errors import InsecureSettings, UnsafeSettings
from jobfence.config.security import DEV_SECRET, is_loopback
from jobfence.config.urls import check_lock_url, check_url, redact

ENV_PREFIX = "JOBFENCE_"
URL_FIELDS = ("lock_url", "broker_url", "result_backend", "database_url")

# JOBFENCE_* variables jobfence reads outside Settings (the demo's faults and journal, the
# Celery benchmark). The one list `unknown_variables` checks against; tests keep it in step
# with the modules that read them.
OTHER_VARIABLES: tuple[str, ...] = (
    "JOBFENCE_DEMO_FAIL_RATE",
    "JOBFENCE_DEMO_DELAY_MIN_MS",
    "JOBFENCE_DEMO_DELAY_MAX_MS",
    "JOBFENCE_DEMO_SEED",
    "JOBFENCE_DEMO_JOURNAL_URL",
    "JOBFENCE_BENCH_REDIS_URL",
    "JOBFENCE_BENCH_BODY_MS",
    "JOBFENCE_DASHBOARD_TOKEN",
)


class InsecureSettingsWarning(UserWarning):
    """A setting that works but exposes data or weakens security."""


def _is_loopback(host: str | None) -> bool:
    return is_loopback(host)


class Settings(BaseSettings):
    """Everything jobfence reads from the environment; build once, pass down."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
        # Every float field, present and future: NaN passes every `<=` check, inf overflows.
        allow_inf_nan=False,
    )

    lock_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description=(
            "Lock backend URL (redis://, rediss://, unix://, postgresql://, mysql://, "
            "mariadb://, redlock://host:port,..., etcd://host:port[,host:port...], "
            "redis+sentinel://host:port[,host:port...]/<master-name>[/db], "
            "redis+cluster://host:port,..., zookeeper://host:port[,host:port...][/chroot])."
        ),
    )
    broker_url: str | None = Field(default=None, description="Celery broker URL.")
    result_backend: str | None = Field(default=None, description="Celery result backend URL.")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL of the ledger database (payments, stock)."
    )
    default_ttl: float = Field(default=30.0, description="Lease TTL in seconds.")
    heartbeat_fraction: float = Field(
        default=1 / 3, description="Heartbeat interval as a fraction of the TTL."
    )
    acquire_timeout: float = Field(
        default=10.0, description="Seconds a blocking acquire waits before giving up."
    )
    backoff_base: float = Field(default=0.005, description="First backoff step in seconds.")
    backoff_cap: float = Field(default=0.5, description="Largest backoff step in seconds.")
    socket_timeout: float = Field(
        default=2.0, description="Seconds a lock-server call may take before it counts as failed."
    )
    key_prefix: str = Field(default="jobfence", description="Prefix of every key jobfence writes.")
    key_secret: SecretStr = Field(
        default=SecretStr(DEV_SECRET),
        description="HMAC secret used to hash task arguments into keys.",
    )
    # NoDecode: the environment gives `old1,old2` (a JSON list works too); never logged.
    key_secret_previous: Annotated[tuple[SecretStr, ...], NoDecode] = Field(
        default=(),
        description="Earlier key secrets (comma-separated), kept during a rotation so jobs "
        "finished or running under them are still found.",
    )
    key_secret_reset: bool = Field(
        default=False,
        description="Start with a key secret the lock server has not seen and no previous "
        "secret: finished jobs may run again (a deliberate reset only).",
    )
    result_ttl: float = Field(
        default=7 * 24 * 3600.0, description="Seconds a DONE record (stored result) is kept."
    )
    failed_record_message: bool = Field(
        default=False,
        description="Store a failing body's exception message (500 characters at most) in its "
        "FAILED record, kept for `JOBFENCE_RESULT_TTL`; off: the exception's type only, as a "
        "message may hold what the key's HMAC hides (a card number, an address).",
    )
    fence_retention: float = Field(
        default=30 * 24 * 3600.0,
        description="Seconds a per-key fence counter is kept after its last grant.",
    )
    decision_log_size: int = Field(
        default=50,
        ge=0,
        description="Decisions kept per job key for `jobfence locks why` (Redis streams, or "
        "in process for memory://; 0: none kept, the log lines stay).",
    )
    decision_log_total: int = Field(
        default=10_000,
        ge=1,
        description="Entries of the decision log's index (Redis: a capped stream that lets a "
        "task id find its key and keeps the routine runs, started and done, whole; "
        "memory://: decisions kept in all).",
    )
    decision_log_ttl: float = Field(
        default=7 * 24 * 3600.0,
        gt=0,
        description="Seconds a key's decisions are kept after its last one.",
    )
    visibility_timeout: float = Field(
        default=3600.0, description="Broker visibility timeout in seconds (Redis/SQS brokers)."
    )
    max_countdown: float = Field(
        default=0.0,
        description="Longest countdown/ETA the application uses, in seconds (0: not declared).",
    )
    redelivery_limit: int = Field(
        default=20,
        description="Redeliveries of a job whose fate is unknown (lock server down, lease lost, "
        "commit unanswered) before it is given up with a FAILED record; apart from max_retries.",
    )
    redelivery_delay: float = Field(
        default=1.0,
        description="First redelivery countdown in seconds; it doubles, with jitter, up to 60 s.",
    )
    max_crashed_deliveries: int = Field(
        default=5,
        ge=0,
        description="Times a job may be granted again after a delivery that lost its worker "
        "mid-body (no record) before it is recorded FAILED as a poison message (0: no cap).",
    )
    metrics_port: int | None = Field(
        default=None,
        description="Port on which each worker serves Prometheus /metrics, summed over its "
        "pool processes (unset: no endpoint).",
    )
    metrics_addr: str = Field(
        default="127.0.0.1",
        description="Address the /metrics endpoint listens on (0.0.0.0: every interface).",
    )
    metrics_basic_auth: SecretStr | None = Field(
        default=None,
        description="user:password the /metrics endpoint asks for (HTTP basic auth; unset: none).",
    )
    metrics_certfile: str | None = Field(
        default=None,
        description="PEM certificate (chain) file: the /metrics endpoint serves HTTPS with it.",
    )
    metrics_keyfile: str | None = Field(
        default=None, description="PEM private key file of JOBFENCE_METRICS_CERTFILE."
    )
    # NoDecode: the environment gives `cleartext,no-auth` (a JSON list works too).
    allow_insecure: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="Downgrades start-up allows instead of refusing (comma-separated: "
        "unverified-tls, cleartext, no-auth, weak-key-secret); docs/reference/security.md.",
    )
    # NoDecode: the environment gives `json` or `json,application/json` (a JSON list works too).
    accept_content: Annotated[tuple[str, ...], NoDecode] = Field(
        default=("json",), description="Serialisers Celery workers accept (comma-separated)."
    )

    def __init__(self, *args: Any, **values: Any) -> None:
        # Settings() must fail like load_settings(): pydantic's own error shows the input,
        # JOBFENCE_KEY_SECRET and URL passwords included. Raised outside the except block so
        # not even __context__ keeps the ValidationError.
        try:
            super().__init__(*args, **values)
            return
        except ValidationError as exc:
            refused = _unsafe_from(exc)
        except SettingsError as exc:  # a value pydantic-settings could not even decode
            refused = _undecodable(exc)
        refused.__cause__ = refused.__context__ = None  # nothing that holds an input value
        raise refused.with_traceback(None)

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, redact(value) if name in URL_FIELDS and isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """init > env > .env > Django settings (config/django_source.py) > secret files."""
        django = django_sources(settings_cls, unknown_django_settings)
        return (init_settings, env_settings, dotenv_settings, *django, file_secret_settings)

    @field_validator("key_prefix")
    @classmethod
    def _prefix_is_plain(cls, v: str) -> str:
        if not v or any(c in v for c in " {}*?[]"):
            raise ValueError(
                "must be non-empty and free of spaces, braces and glob characters; "
                "set JOBFENCE_KEY_PREFIX to e.g. 'jobfence'"
            )
        return v

    @field_validator("lock_url")
    @classmethod
    def _usable_lock_url(cls, v: str) -> str:
        check_lock_url(v, f"{ENV_PREFIX}LOCK_URL")
        return v

    @field_validator("broker_url", "result_backend")
    @classmethod
    def _usable_celery_url(cls, v: str | None, info: Any) -> str | None:
        if v:
            check_url(v, variable=ENV_PREFIX + info.field_name.upper(), schemes=None,
                      example="redis://127.0.0.1:6379/1 or amqp://guest:guest@127.0.0.1:5672//",
                      what="Celery URL")
        return v

    @field_validator("database_url")
    @classmethod
    def _usable_database_url(cls, v: str | None) -> str | None:
        if v:
            check_url(v, variable=f"{ENV_PREFIX}DATABASE_URL", schemes=None,
                      example="postgresql+psycopg://user:password@127.0.0.1:5432/shop "
                      "or sqlite:///ledger.sqlite",
                      what="database URL")
        return v

    @field_validator("key_secret_previous", mode="before")
    @classmethod
    def _split_previous_secrets(cls, v: Any) -> Any:
        """`old1,old2` or a JSON list, as the environment spells it; refused without the value."""
        return _split_list(v, "KEY_SECRET_PREVIOUS", "list the earlier secrets separated by commas")

    @field_validator("allow_insecure", mode="before")
    @classmethod
    def _split_allowed(cls, v: Any) -> Any:
        """`cleartext,no-auth` or a JSON list; each a known downgrade name."""
        items = _split_list(v, "ALLOW_INSECURE", "list downgrades separated by commas")
        return security.parse_allowed(items) if isinstance(items, tuple | list) else items

    @field_validator("accept_content", mode="before")
    @classmethod
    def _split_content_types(cls, v: Any) -> Any:
        """`json`, `json,application/json` or a JSON list, as the environment spells them."""
        return _split_list(v, "ACCEPT_CONTENT", f"set {ENV_PREFIX}ACCEPT_CONTENT=json")

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> Settings:
        refuse_unsafe(self)
        warn_insecure(self)
        return self

    @property
    def heartbeat_interval(self) -> float:
        return self.default_ttl * self.heartbeat_fraction

    def server_urls(self) -> dict[str, str | None]:
        """Each server URL by the variable that sets it (what the security checks judge)."""
        return {_variable(f): getattr(self, f) for f in URL_FIELDS}

    def downgrades(
        self, extra: Mapping[str, str | None] | None = None, lock_security: Any = None
    ) -> list[security.Downgrade]:
        """Every security downgrade of these settings (and `extra` URLs, e.g. an app's own
        broker; `lock_security`, the lock backend's own `security()`): docs/reference/security.md.
        Whether each is allowed is JOBFENCE_ALLOW_INSECURE's say."""
        urls = {**self.server_urls(), **(extra or {})}
        return security.downgrades(
            urls, self.key_secret.get_secret_value(), _variable("lock_url"),
            _variable("key_secret"), lock_security,
        )  # fmt: skip

    def secret_bytes(self) -> bytes:
        return self.key_secret.get_secret_value().encode()

    def previous_secret_bytes(self) -> tuple[bytes, ...]:
        """The earlier key secrets still looked up (JOBFENCE_KEY_SECRET_PREVIOUS), in order."""
        mine = self.secret_bytes()
        found = (s.get_secret_value().encode() for s in self.key_secret_previous)
        return tuple(dict.fromkeys(s for s in found if s != mine))


def refuse_unsafe(s: Settings) -> None:
    """Raise UnsafeSettings naming the variable and the fix for any unsafe combination."""
    p = ENV_PREFIX
    if s.default_ttl <= 0:
        raise UnsafeSettings(
            f"{p}DEFAULT_TTL",
            f"must be > 0, got {s.default_ttl}",
            "set a lease TTL in seconds, e.g. 30",
        )
    if not 0 < s.heartbeat_fraction < 0.5:
        raise UnsafeSettings(
            f"{p}HEARTBEAT_FRACTION",
            f"heartbeat interval {s.heartbeat_interval:g}s must be < TTL/2 "
            f"({s.default_ttl / 2:g}s), got fraction {s.heartbeat_fraction:g}",
            "use a fraction below 0.5; 1/3 is the default",
        )
    if s.acquire_timeout < 0:
        raise UnsafeSettings(
            f"{p}ACQUIRE_TIMEOUT",
            f"must be >= 0, got {s.acquire_timeout}",
            "use 0 to never wait, or a number of seconds",
        )
    if s.backoff_base <= 0 or s.backoff_cap < s.backoff_base:
        raise UnsafeSettings(
            f"{p}BACKOFF_BASE",
            f"need 0 < base <= cap, got base={s.backoff_base} cap={s.backoff_cap}",
            "e.g. JOBFENCE_BACKOFF_BASE=0.005 JOBFENCE_BACKOFF_CAP=0.5",
        )
    if not s.key_secret.get_secret_value().strip():
        raise UnsafeSettings(
            f"{p}KEY_SECRET",
            "is empty: every deployment would hash task arguments under the same known key",
            f"set {p}KEY_SECRET to a random string of at least {security.MIN_KEY_SECRET} "
            "characters",
        )
    refuse_url_timeouts(s)
    if s.socket_timeout <= 0 or s.socket_timeout >= s.default_ttl - s.heartbeat_interval:
        raise UnsafeSettings(
            f"{p}SOCKET_TIMEOUT",
            f"{s.socket_timeout:g}s must be > 0 and shorter than TTL - heartbeat interval "
            f"({s.default_ttl - s.heartbeat_interval:g}s), or a hung extension outlives the lease",
            "lower JOBFENCE_SOCKET_TIMEOUT or raise JOBFENCE_DEFAULT_TTL",
        )
    if s.result_ttl <= 0:
        raise UnsafeSettings(
            f"{p}RESULT_TTL",
            f"must be > 0, got {s.result_ttl}",
            "keep results at least as long as duplicates may arrive",
        )
    if s.decision_log_size > s.decision_log_total:
        raise UnsafeSettings(
            f"{p}DECISION_LOG_TOTAL",
            f"{s.decision_log_total} is below {p}DECISION_LOG_SIZE ({s.decision_log_size})",
            f"keep {p}DECISION_LOG_TOTAL at least {p}DECISION_LOG_SIZE (default 10000)",
        )
    if s.fence_retention < s.default_ttl:
        raise UnsafeSettings(
            f"{p}FENCE_RETENTION",
            "must be at least the lease TTL",
            "keep fence counters for days, e.g. 2592000",
        )
    if s.redelivery_limit < 0:
        raise UnsafeSettings(
            f"{p}REDELIVERY_LIMIT",
            f"must be >= 0, got {s.redelivery_limit}",
            "use 0 to give a job up at its first unknown outcome, or e.g. 20",
        )
    if not 0 < s.redelivery_delay <= 60:
        raise UnsafeSettings(
            f"{p}REDELIVERY_DELAY",
            f"must be > 0 and at most 60 seconds, got {s.redelivery_delay}",
            "use a first redelivery countdown such as 1",
        )
    refuse_metrics_clash(s)
    bad = [c for c in s.accept_content if c not in SAFE_CONTENT]
    if bad:
        raise UnsafeSettings(
            f"{p}ACCEPT_CONTENT",
            f"refusing serialisers {bad}: pickle and friends run code from the broker",
            "accept only json",
        )
    if s.max_countdown and s.max_countdown >= s.visibility_timeout:
        raise UnsafeSettings(
            f"{p}VISIBILITY_TIMEOUT",
            f"{s.visibility_timeout:g}s is not longer than the longest countdown "
            f"({s.max_countdown:g}s): the broker redelivers every such job while it waits",
            "raise JOBFENCE_VISIBILITY_TIMEOUT above JOBFENCE_MAX_COUNTDOWN",
        )


#: What workers may accept: JSON, and Celery's `auth` serializer (JSON signed with the
#: app's key; app.setup_security(), docs/reference/security.md).
SAFE_CONTENT = ("json", "application/json", "auth", "application/data")


def refuse_url_timeouts(s: Settings) -> None:
    """A timeout in the lock URL's query wins over JOBFENCE_SOCKET_TIMEOUT in the client, so
    the effective value is the one checked against the lease."""
    limit = s.default_ttl - s.heartbeat_interval
    for name, value in security.query_timeouts(s.lock_url).items():
        if value is None or not 0 < value < limit:
            shown = "not a number" if value is None else f"{value:g}s"
            raise UnsafeSettings(
                f"{ENV_PREFIX}LOCK_URL",
                f"its option {name} ({shown}) overrides {ENV_PREFIX}SOCKET_TIMEOUT "
                f"({s.socket_timeout:g}s) and must be > 0 and shorter than TTL - heartbeat "
                f"interval ({limit:g}s), or a hung extension outlives the lease",
                f"remove {name} from the URL and set {ENV_PREFIX}SOCKET_TIMEOUT instead",
            )


def _local_ports(s: Settings) -> Iterable[tuple[str, int]]:
    """(variable, port) of every server URL in `s` on this host (the ports it must not take)."""
    for field in URL_FIELDS:
        url = getattr(s, field)
        if not url:
            continue
        for part in urlsplit(url).netloc.rpartition("@")[2].split(","):
            host, _, port = part.rpartition(":")
            host = host.strip("[]")
            if port.isdigit() and (_is_loopback(host) or host in ("0.0.0.0", "::")):
                yield _variable(field), int(port)


def refuse_metrics_clash(s: Settings) -> None:
    """JOBFENCE_METRICS_PORT: a real port, and not one a server jobfence talks to uses here."""
    port = s.metrics_port
    if port is None:
        return
    variable = _variable("metrics_port")
    if not 1 <= port <= 65535:
        raise UnsafeSettings(
            variable,
            f"must be a TCP port from 1 to 65535, got {port}",
            "pick a free port for each worker on a host, e.g. 9816, or unset it",
        )
    for other, taken in _local_ports(s):
        if taken == port:
            raise UnsafeSettings(
                variable,
                f"{port} is the port of {other}, a server on this host",
                "pick a free port for the metrics endpoint, e.g. 9816",
            )
    if (s.metrics_certfile is None) != (s.metrics_keyfile is None):
        raise UnsafeSettings(
            _variable("metrics_certfile"),
            "and JOBFENCE_METRICS_KEYFILE must be set together (HTTPS needs both)",
            "set both to PEM files, or neither for plain HTTP",
        )
    auth = s.metrics_basic_auth
    if auth is not None and ":" not in auth.get_secret_value():
        raise UnsafeSettings(
            _variable("metrics_basic_auth"),
            "must be user:password",
            "set it to e.g. prometheus:<a long random password>",
        )
    try:
        ipaddress.ip_address(s.metrics_addr)
    except ValueError:
        if s.metrics_addr != "localhost":
            raise UnsafeSettings(
                _variable("metrics_addr"),
                "must be an IP address to listen on",
                "use 127.0.0.1 (this host, the default), 0.0.0.0 (every interface) or ::",
            ) from None


def warn_insecure(s: Settings) -> None:
    """Warn (not refuse: the worker's start-up check does) about each security downgrade
    JOBFENCE_ALLOW_INSECURE does not allow."""
    for d in s.downgrades():
        if d.item in s.allow_insecure:
            continue
        warnings.warn(
            f"{d.variable}: {d.problem}. Fix: {d.fix} (a worker refuses to start with it "
            f"unless {security.ALLOW_VARIABLE} includes {d.item})",
            InsecureSettingsWarning,
            stacklevel=2,
        )


def refuse_insecure(s: Settings) -> None:
    """Raise InsecureSettings for each security downgrade JOBFENCE_ALLOW_INSECURE does not
    allow. Judges the settings' text only (no I/O): call it before opening a connection."""
    found = [
        InsecureSettings(d.variable, d.problem, security.refusal_fix(d))
        for d in s.downgrades()
        if d.item not in s.allow_insecure
    ]
    if found:
        first, *also = found
        raise first.with_also(also) if also else first


def _variable(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _fix_for(field: str) -> str:
    info = Settings.model_fields.get(field)
    if info is None:
        return "remove it or correct its name"
    what = (info.description or "").rstrip(".")
    if field in ("key_secret", "key_secret_previous"):  # never shown, not even the dev default
        return f"set {_variable(field)} to a long random string ({what})"
    return f"set {_variable(field)} to a valid value ({what}; default {info.default!r})"


def _unsafe_from(exc: ValidationError) -> UnsafeSettings:
    """One UnsafeSettings for every problem, built without the input values."""
    found: list[UnsafeSettings] = []
    for err in exc.errors(include_input=False, include_url=False):
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, UnsafeSettings):
            found.append(cause)
            continue
        field = str(err["loc"][0]) if err["loc"] else ""
        msg = err["msg"].removeprefix("Value error, ")
        fix = _fix_for(field)
        if err["type"] == "finite_number":
            msg = "must be a finite number; NaN and infinity are refused"
            fix = fix.replace("to a valid value", "to a finite number", 1)
        variable = _variable(field) if field else "settings"
        found.append(UnsafeSettings(variable, msg, fix))
    first, *also = found
    return first.with_also(also) if also else first


def _undecodable(exc: SettingsError) -> UnsafeSettings:
    """pydantic-settings names the field in its message: keep the name, drop the rest."""
    text = str(exc)
    field = next((f for f in Settings.model_fields if f'"{f}"' in text), "")
    return UnsafeSettings(
        _variable(field) if field else "settings",
        "could not be decoded",
        _fix_for(field) if field else "check the JOBFENCE_* variables",
    )


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from the environment; every problem is an UnsafeSettings (as Settings())."""
    return Settings(**overrides)


def known_variables() -> frozenset[str]:
    """Every JOBFENCE_* name jobfence reads: Settings' fields and OTHER_VARIABLES."""
    return frozenset({_variable(f) for f in Settings.model_fields} | set(OTHER_VARIABLES))


def _env_file_names() -> list[str]:
    env_file = Settings.model_config.get("env_file")
    if not isinstance(env_file, str | os.PathLike) or not Path(env_file).is_file():
        return []
    from dotenv import dotenv_values  # pydantic-settings' own .env reader

    return list(dotenv_values(env_file))


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """(name, closest known name or None) for each JOBFENCE_* variable jobfence never reads.

    A typo (JOBFENCE_DEFAULT_TLL) otherwise leaves the default in force without a word.
    With no `environ`, the process environment and the `.env` file Settings reads.
    """
    names = list(os.environ) + _env_file_names() if environ is None else list(environ)
    known = known_variables()
    out: list[tuple[str, str | None]] = []
    for name in sorted({n for n in names if n.upper().startswith(ENV_PREFIX)}):
        if name.upper() in known:
            continue
        out.append((name, closest_name(name, known)))
    return out


def closest_name(name: str, known: Iterable[str] | None = None) -> str | None:
    """The known JOBFENCE_* name `name` is most likely a typo of, or None: the one "did you
    mean" of the environment, `.env` and Django settings alike."""
    names = known_variables() if known is None else known
    # Compared without the shared prefix, which would make every name look close.
    tails = sorted(k.removeprefix(ENV_PREFIX) for k in names)
    tail = name.upper().removeprefix(ENV_PREFIX)
    close = difflib.get_close_matches(tail, tails, n=1, cutoff=0.6)
    return ENV_PREFIX + close[0] if close else None


def unknown_django_settings() -> list[tuple[str, str | None]]:
    """(name, closest known name or None) for each JOBFENCE_* name in Django settings that
    jobfence never reads; empty when this process uses no Django settings."""
    conf = django_settings()
    if conf is None:
        return []
    known = known_variables()
    return [(n, closest_name(n, known)) for n in sorted(dir(conf))
            if n.startswith(ENV_PREFIX) and n not in known]  # fmt: skip


def setting_source(field: str, overrides: Mapping[str, Any] | None = None) -> str:
    """Where the value of `field` came from, in the precedence Settings reads them: an
    explicit value, the environment, `.env`, Django settings (naming the module) or the
    default. Says so without the value."""
    variable = _variable(field)
    if overrides and overrides.get(field) is not None:
        return "given explicitly"
    if variable in os.environ:
        return f"the environment ({variable})"
    if variable in _env_file_names():
        return f"the .env file ({variable})"
    conf = django_settings()
    if conf is not None and hasattr(conf, variable):
        module = os.environ.get("DJANGO_SETTINGS_MODULE") or "settings.configure()"
        return f"Django settings {module} ({variable})"
    return f"the default: {variable} is set nowhere"


def _split_list(v: Any, name: str, fix: str) -> Any:
    """A list setting as the environment spells it: `a,b` or a JSON list; refused (naming
    the variable, never the value) when it is neither."""
    if not isinstance(v, str):
        return v
    text = v.strip()
    if text.startswith("["):
        try:
            return tuple(json.loads(text))
        except (ValueError, TypeError):
            raise UnsafeSettings(
                f"{ENV_PREFIX}{name}",
                "is neither a comma-separated list nor a JSON list of strings",
                fix,
            ) from None
    return tuple(part.strip() for part in text.split(",") if part.strip())
