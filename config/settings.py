"""Typed, validated settings for jobfence, read from JOBFENCE_* environment variables."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

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
from jobfence.config.refusals import (
    SAFE_CONTENT,
    InsecureSettingsWarning,
    refuse_insecure,
    refuse_metrics_clash,
    refuse_unsafe,
    refuse_url_timeouts,
    undecodable,
    unsafe_from,
    warn_insecure,
)
from jobfence.config.security import DEV_SECRET
from jobfence.config.urls import check_lock_url, check_url, redact
from jobfence.config.variables import (
    ENV_PREFIX,
    OTHER_URLS,
    OTHER_VARIABLES,
    URL_FIELDS,
    split_list,
    variable_name,
)

# Settings, and what this module offered before refusals.py and variables.py took it over.
__all__ = [
    "ENV_PREFIX",
    "OTHER_VARIABLES",
    "SAFE_CONTENT",
    "URL_FIELDS",
    "InsecureSettingsWarning",
    "Settings",
    "closest_name",
    "known_variables",
    "load_settings",
    "refuse_insecure",
    "refuse_metrics_clash",
    "refuse_unsafe",
    "refuse_url_timeouts",
    "setting_source",
    "unknown_django_settings",
    "unknown_variables",
    "warn_insecure",
]


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
    outbox_url: str | None = Field(default=None, description="SQLAlchemy URL of the database "
        "holding jobfence_outbox: set, the workers run its relay, one at a time.")  # fmt: skip
    outbox_grace: float = Field(default=5.0, gt=0, description="Seconds a committed, unsent "
        "outbox row waits before the relay sends it.")  # fmt: skip
    outbox_poll: float = Field(default=1.0, gt=0, description="Seconds between the leading "
        "relay's looks at the outbox.")  # fmt: skip
    outbox_retention: float = Field(default=86400.0, gt=0, description="Seconds a sent outbox "
        "row is kept before it is pruned.")  # fmt: skip
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
            refused = unsafe_from(exc, Settings.model_fields)
        except SettingsError as exc:  # a value pydantic-settings could not even decode
            refused = undecodable(exc, Settings.model_fields)
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

    @field_validator("broker_url", "result_backend", "database_url", "outbox_url")
    @classmethod
    def _usable_url(cls, v: str | None, info: Any) -> str | None:
        if v:
            what, example = OTHER_URLS[info.field_name in ("database_url", "outbox_url")]
            check_url(v, variable=ENV_PREFIX + info.field_name.upper(), schemes=None,
                      example=example, what=what)  # fmt: skip
        return v

    @field_validator("key_secret_previous", mode="before")
    @classmethod
    def _split_previous_secrets(cls, v: Any) -> Any:
        """`old1,old2` or a JSON list, as the environment spells it; refused without the value."""
        return split_list(v, "KEY_SECRET_PREVIOUS", "list the earlier secrets separated by commas")

    @field_validator("allow_insecure", mode="before")
    @classmethod
    def _split_allowed(cls, v: Any) -> Any:
        """`cleartext,no-auth` or a JSON list; each a known downgrade name."""
        items = split_list(v, "ALLOW_INSECURE", "list downgrades separated by commas")
        return security.parse_allowed(items) if isinstance(items, tuple | list) else items

    @field_validator("accept_content", mode="before")
    @classmethod
    def _split_content_types(cls, v: Any) -> Any:
        """`json`, `json,application/json` or a JSON list, as the environment spells them."""
        return split_list(v, "ACCEPT_CONTENT", f"set {ENV_PREFIX}ACCEPT_CONTENT=json")

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
        return {variable_name(f): getattr(self, f) for f in URL_FIELDS}

    def downgrades(
        self, extra: Mapping[str, str | None] | None = None, lock_security: Any = None
    ) -> list[security.Downgrade]:
        """Every security downgrade of these settings (and `extra` URLs, e.g. an app's own
        broker; `lock_security`, the lock backend's own `security()`): docs/reference/security.md.
        Whether each is allowed is JOBFENCE_ALLOW_INSECURE's say."""
        urls = {**self.server_urls(), **(extra or {})}
        return security.downgrades(
            urls, self.key_secret.get_secret_value(), variable_name("lock_url"),
            variable_name("key_secret"), lock_security,
        )  # fmt: skip

    def secret_bytes(self) -> bytes:
        return self.key_secret.get_secret_value().encode()

    def previous_secret_bytes(self) -> tuple[bytes, ...]:
        """The earlier key secrets still looked up (JOBFENCE_KEY_SECRET_PREVIOUS), in order."""
        mine = self.secret_bytes()
        found = (s.get_secret_value().encode() for s in self.key_secret_previous)
        return tuple(dict.fromkeys(s for s in found if s != mine))


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from the environment; every problem is an UnsafeSettings (as Settings())."""
    return Settings(**overrides)


def known_variables() -> frozenset[str]:
    """Every JOBFENCE_* name jobfence reads: Settings' fields and OTHER_VARIABLES."""
    return frozenset({variable_name(f) for f in Settings.model_fields} | set(OTHER_VARIABLES))


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
    variable = variable_name(field)
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
