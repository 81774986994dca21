"""PostgreSQL job records, the publish claim, the delivery count, and the pruning of unused rows."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, suppress
from typing import Any

import psycopg

from jobfence.locks.backend import JobRecord
from jobfence.locks.backends.postgres.protocol import parse_job_record
from jobfence.locks.backends.postgres.statements import (
    CLAIM_PUBLISH,
    CLEAR_PUBLISH,
    COUNT_DELIVERY,
    FORGET,
    JOB_RECORD,
    PRUNE,
    PRUNE_RATES,
    PRUNE_TURN,
    SWAP_PUBLISH,
)
from jobfence.locks.clock import Clock
from jobfence.locks.errors import BackendUnavailable


class PostgresRecords:
    """The records half of PostgresBackend (mixed in): a job's final record, the queued-task
    claim and the crash-suspect delivery count in the lease's row, one statement each."""

    prefix: str
    clock: Clock
    prune_interval: float
    fence_retention_ms: int
    _ready: bool
    _next_prune: float

    def _conn(self, what: str, key: str | None) -> AbstractContextManager[psycopg.Connection[Any]]:
        raise NotImplementedError  # PostgresBackend's

    def create_tables(self) -> None:
        raise NotImplementedError  # PostgresBackend's

    def _run(self, what: str, key: str | None, sql: str, params: Any) -> list[tuple[Any, ...]]:
        raise NotImplementedError  # PostgresBackend's

    def job_record(self, key: str) -> JobRecord | None:
        return parse_job_record(self._run("job_record", key, JOB_RECORD, (self.prefix, key)))

    def forget(self, key: str) -> bool:
        return bool(self._run("forget", key, FORGET, (self.prefix, key))[0][0])

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        params = {"prefix": self.prefix, "key": key, "task_id": task_id,
                  "ttl": max(1, int(ttl * 1000))}  # fmt: skip
        held = self._run("claim_publish", key, CLAIM_PUBLISH, params)[0][0]
        return held if held and held != task_id else None

    def clear_publish(self, key: str) -> None:
        self._run("clear_publish", key, CLEAR_PUBLISH, (self.prefix, key))

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        params = {"prefix": self.prefix, "key": key, "expect": expect, "new": new,
                  "ttl": ttl_ms}  # fmt: skip
        kept: str | None = self._run("swap_publish", key, SWAP_PUBLISH, params)[0][0]
        return kept

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        params = {"prefix": self.prefix, "key": key, "window": window_ms}
        return int(self._run("count_delivery", key, COUNT_DELIVERY, params)[0][0])

    def prune(self) -> int | None:
        """Delete rows unused for the fence retention; None if another pass ran lately."""
        if not self._ready:
            self.create_tables()
        with self._conn("prune", None) as conn, conn.transaction():
            interval_ms = max(1, int(self.prune_interval * 1000))
            if conn.execute(PRUNE_TURN, (self.prefix, interval_ms)).fetchone() is None:
                return None
            conn.execute("SET LOCAL statement_timeout = '60s'")
            pruned = conn.execute(PRUNE, (self.prefix, self.fence_retention_ms)).rowcount
            return pruned + conn.execute(PRUNE_RATES, (self.prefix,)).rowcount

    def _prune_soon(self) -> None:
        """Prune in a daemon thread, off the caller's path; errors wait for the next turn."""
        self._next_prune = self.clock.monotonic() + self.prune_interval

        def run() -> None:
            with suppress(BackendUnavailable):
                self.prune()

        threading.Thread(target=run, name="jobfence-pg-prune", daemon=True).start()
