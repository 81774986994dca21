"""JOBFENCE_* variables: the prefix, the URL fields, those read elsewhere, how a list is spelled."""

from __future__ import annotations

import json
from typing import Any

from jobfence.config.errors import UnsafeSettings

ENV_PREFIX = "JOBFENCE_"
URL_FIELDS = ("lock_url", "broker_url", "result_backend", "database_url", "outbox_url")

#: What a URL other than the lock server's is, and an example, by "is it a database".
OTHER_URLS = {
    False: ("Celery URL", "redis://127.0.0.1:6379/1 or amqp://guest:guest@127.0.0.1:5672//"),
    True: ("database URL", "postgresql+psycopg://user:password@127.0.0.1:5432/shop or "
           "sqlite:///ledger.sqlite"),
}  # fmt: skip

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


def variable_name(field: str) -> str:
    """The variable that sets the Settings field `field` (lock_url: JOBFENCE_LOCK_URL)."""
    return ENV_PREFIX + field.upper()


def split_list(v: Any, name: str, fix: str) -> Any:
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
