"""Demo fault injection from JOBFENCE_DEMO_* settings: slow bodies, one transient failure."""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import time
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobfence.config.errors import JobfenceError, UnsafeSettings

log = logging.getLogger(__name__)
APP_ATTRIBUTE = "jobfence_demo_faults"
ENV_PREFIX = "JOBFENCE_DEMO_"


class TransientError(JobfenceError):
    """A failure worth retrying (the demo's 'payment gateway timed out'); tasks autoretry it."""


class DemoFaults(BaseSettings):
    """What the demo injects into workflow bodies. Off by default.

    Which jobs fail is a pure function of (seed, business id), never of the message, so it
    adds no task argument: the idempotency key and the argument fingerprint are unchanged,
    and every worker process agrees on which ids fail. A chosen id fails on its first
    attempt (request.retries == 0) and succeeds on the retry.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    fail_rate: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Share of ids whose first attempt fails."
    )
    delay_min_ms: float = Field(
        default=0.0, ge=0.0, le=60_000.0, description="Shortest pause in the body, ms."
    )
    delay_max_ms: float = Field(
        default=0.0, ge=0.0, le=60_000.0, description="Longest pause in the body, ms."
    )
    seed: str = Field(default="jobfence-demo", description="Changes which ids fail.")

    @model_validator(mode="after")
    def _ordered(self) -> DemoFaults:
        if self.delay_max_ms < self.delay_min_ms:
            raise ValueError(
                f"{ENV_PREFIX}DELAY_MAX_MS ({self.delay_max_ms:g}) must be >= "
                f"{ENV_PREFIX}DELAY_MIN_MS ({self.delay_min_ms:g})"
            )
        return self

    def fails_once(self, ident: str) -> bool:
        """True if `ident`'s first attempt is to fail (stable across processes and runs)."""
        if self.fail_rate <= 0.0:
            return False
        digest = hashlib.sha256(f"{self.seed}\n{ident}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.fail_rate

    def pause(self) -> float:
        """Sleep a random time in [delay_min_ms, delay_max_ms]; returns the seconds slept."""
        if self.delay_max_ms <= 0.0:
            return 0.0
        seconds = random.uniform(self.delay_min_ms, self.delay_max_ms) / 1000.0
        time.sleep(seconds)
        return seconds

    def inject(self, what: str, ident: str, attempt: int) -> None:
        """Call at the top of a body, before any effect: pause, then maybe fail once."""
        self.pause()
        if attempt == 0 and self.fails_once(ident):
            log.info("demo fault: %s %s fails its first attempt", what, ident)
            raise TransientError(f"demo fault: {what} {ident} timed out on its first attempt")


@functools.cache
def _from_environment() -> DemoFaults:
    try:
        return DemoFaults()
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ENV_PREFIX + ".".join(str(x) for x in err["loc"]).upper() if err["loc"] else ""
        raise UnsafeSettings(
            field or ENV_PREFIX + "*", err["msg"], "fix the demo fault settings"
        ) from None


def install_faults(app: Any, faults: DemoFaults | None) -> None:
    """Give `app`'s workflow tasks these faults (None: back to the JOBFENCE_DEMO_* ones)."""
    setattr(app, APP_ATTRIBUTE, faults)


def faults_for(app: Any) -> DemoFaults:
    """The faults installed on `app`, else those of the environment (read once per process)."""
    faults = getattr(app, APP_ATTRIBUTE, None)
    return faults if isinstance(faults, DemoFaults) else _from_environment()
