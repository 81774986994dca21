"""The PostgreSQL lock backend as one package; `PostgresBackend` and what callers use, re-exported.

Its URL and connections, its sync and asyncio stores, its semaphores and its start-up checks:

- statements.py: the tables, their DDL and every statement; protocol.py: their parameters
  and answers, shared by both stores
- connection.py: the URL as libpq options, a pooler in between, fork hygiene
- backend.py: PostgresBackend, the lock core; records.py: job records, claims, pruning
- semaphores.py: the semaphore half; checks.py: the start-up checks
- async_store.py: AsyncPostgresStore (not imported here: the registry names it)
"""

from __future__ import annotations

from jobfence.locks.backends.postgres.backend import (
    POLL_CAP,
    POLL_FIRST,
    PRUNE_INTERVAL,
    PostgresBackend,
)
from jobfence.locks.backends.postgres.connection import (
    DEFAULT_PORT,
    OPTIONS_FIX,
    SCHEMES,
    SERVER_PID,
    behind_pooler,
    options_refused,
    without_session_state,
)
from jobfence.locks.backends.postgres.protocol import (
    begin_params,
    commit_params,
    extend_params,
    parse_begin,
    parse_extend,
    parse_job_record,
    wake_params,
)
from jobfence.locks.backends.postgres.semaphores import PostgresSemaphores
from jobfence.locks.backends.postgres.statements import (
    CHANNEL,
    FENCE_SEQUENCE,
    RATE_TABLE,
    TABLE,
)

__all__ = [
    "CHANNEL", "DEFAULT_PORT", "FENCE_SEQUENCE", "OPTIONS_FIX", "POLL_CAP", "POLL_FIRST",
    "PRUNE_INTERVAL", "RATE_TABLE", "SCHEMES", "SERVER_PID", "TABLE", "PostgresBackend",
    "PostgresSemaphores", "begin_params", "behind_pooler", "commit_params", "extend_params",
    "options_refused", "parse_begin", "parse_extend", "parse_job_record", "wake_params",
    "without_session_state",
]  # fmt: skip
