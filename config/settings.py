"""Typed, validated settings for jobfence, read from JOBFENCE_* environment variables."""

from __future__ import annotations

import ipaddress
import warnings
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from jobfence.config.django_source import django_sources
from jobfence.config.errors import UnsafeSettings

ENV_PREFIX = "JOBFENCE_"
DEV_SECRET = "jobfence-insecure-dev-secret"
SUPPORTED_LOCK_SCHEMES = ("redis", "rediss", "unix", "memory")


class InsecureSettingsWarning(UserWarning):
    """A setting that works but exposes data or weakens security."""


def _is_loopback(host: str | None) -> bool:
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Everything jobfence reads from the environment; build once, pass down."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
    )

    lock_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Lock backend URL (redis://, rediss://, unix://).",
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
    result_ttl: float = Field(
        default=7 * 24 * 3600.0, description="Seconds a DONE record (stored result) is kept."
    )
    fence_retention: float = Field(
        default=30 * 24 * 3600.0,
        description="Seconds a per-key fence counter is kept after its last grant.",
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
    accept_content: tuple[str, ...] = Field(
        default=("json",), description="Serialisers Celery workers accept."
    )

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
        django = django_sources(settings_cls)
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
    def _known_scheme(cls, v: str) -> str:
        scheme = urlsplit(v).scheme
        if scheme not in SUPPORTED_LOCK_SCHEMES:
            raise ValueError(
                f"scheme {scheme!r} is not supported; set JOBFENCE_LOCK_URL to one of "
                + ", ".join(f"{s}://..." for s in SUPPORTED_LOCK_SCHEMES)
            )
        return v

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> Settings:
        refuse_unsafe(self)
        warn_insecure(self)
        return self

    @property
    def heartbeat_interval(self) -> float:
        return self.default_ttl * self.heartbeat_fraction

    def secret_bytes(self) -> bytes:
        return self.key_secret.get_secret_value().encode()


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
    bad = [c for c in s.accept_content if c not in ("json", "application/json")]
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


def warn_insecure(s: Settings) -> None:
    """Warn (not refuse) about settings that leak data or weaken security."""
    u = urlsplit(s.lock_url)
    if u.scheme == "redis" and not u.password and not _is_loopback(u.hostname):
        warnings.warn(
            f"{ENV_PREFIX}LOCK_URL points at {u.hostname} with neither password nor TLS; "
            "use rediss:// or add a password",
            InsecureSettingsWarning,
            stacklevel=2,
        )
    if s.key_secret.get_secret_value() == DEV_SECRET and not _is_loopback(u.hostname):
        warnings.warn(
            f"{ENV_PREFIX}KEY_SECRET is the development default; set a random secret",
            InsecureSettingsWarning,
            stacklevel=2,
        )


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from the environment, turning validation errors into UnsafeSettings."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, UnsafeSettings):
            raise cause from None
        field = ENV_PREFIX + ".".join(str(x) for x in err["loc"]).upper()
        raise UnsafeSettings(field, err["msg"], f"set {field} to a valid value") from None
