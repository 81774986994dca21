"""MySQL/MariaDB job records, the publish claim, the delivery count, the sweep of expired rows."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from jobfence.locks.backend import CommitRecord, JobRecord
from jobfence.locks.backends.mysql.tables import NOW_US, key_hash
from jobfence.locks.errors import BackendUnavailable

PURGE_EVERY = 60.0  # seconds between sweeps of expired rows (one statement per table)
PURGE_BATCH = 500


class MySQLRecords:
    """The records half of MySQLBackend (mixed in): a job's final record, the queued-task
    claim and the crash-suspect delivery count, each one round trip of `_run`."""

    tables: dict[str, str]
    rate_table: str
    _sql: dict[str, str]
    _next_purge: float

    def _run(self, sql: str, params: Any, key: str | None) -> list[Any]:
        raise NotImplementedError  # MySQLBackend's

    def _commit(self, rec: CommitRecord) -> bool:
        key, owner, fence, state, result, fingerprint, result_ttl_ms = rec
        params = {
            "h": key_hash(key),
            "k": key,
            "o": owner,
            "st": state,
            "fp": fingerprint,
            "res": result,
            "fence": fence,
            "rttl": result_ttl_ms * 1000,
        }
        sets = self._run(self._sql["commit"], params, key)
        ok = bool(int(sets[-1][0][0] or 0))
        self._maybe_purge()
        return ok

    def job_record(self, key: str) -> JobRecord | None:
        rows = self._run(self._sql["job_record"], (key_hash(key),), key)[0]
        return job_record_of(rows[0]) if rows else None

    def forget(self, key: str) -> bool:
        return bool(self._run(self._sql["forget"], (key_hash(key),), key)[0])

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        params = {"h": key_hash(key), "v": task_id, "ttl": max(1000, int(ttl * 1e6))}
        sets = self._run(self._sql["claim_publish"], params, key)
        held = next(s for s in sets if isinstance(s, list))
        value = held[0][0] if held else None
        return value if value and value != task_id else None

    def clear_publish(self, key: str) -> None:
        self._run(self._sql["clear_publish"], (key_hash(key),), key)

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        ttl_us = ttl_ms * 1000 if new is not None else 0
        params = {"h": key_hash(key), "e": expect, "v": new or "", "ttl": ttl_us}
        sets = self._run(self._sql["swap_publish"], params, key)
        rows = next(s for s in sets if isinstance(s, list))
        kept = rows[0][0] if rows else None
        return str(kept) if kept else None

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        params = {"h": key_hash(key), "ttl": window_ms * 1000}
        sets = self._run(self._sql["count_delivery"], params, key)
        rows = next(s for s in sets if isinstance(s, list))
        return int(rows[0][0])

    def purge(self) -> int:
        """Delete rows that expired a minute ago or more (locks, job records, markers, idle
        rate limiters).

        Expired rows are dead already (every read filters on expiry); this only keeps the
        tables small. Runs from `commit` at most once a minute per client; best effort.
        """
        total = 0
        for table in ("locks", "jobs", "marks"):
            sets = self._run(
                f"DELETE FROM {self.tables[table]} WHERE expires_at < NOW(6) - INTERVAL 1 MINUTE"
                f" LIMIT {PURGE_BATCH}",
                (),
                None,
            )
            total += int(sets[0])
        # A limiter whose next turn is past is idle: its row means what no row means.
        sets = self._run(
            f"DELETE FROM {self.rate_table} WHERE tat < {NOW_US} - 60000000 LIMIT {PURGE_BATCH}",
            (),
            None,
        )
        return total + int(sets[0])

    def _maybe_purge(self) -> None:
        now = time.monotonic()
        if now < self._next_purge:
            return
        self._next_purge = now + PURGE_EVERY
        with contextlib.suppress(BackendUnavailable):  # a sweep can wait for the next minute
            self.purge()


def job_record_of(row: Sequence[Any]) -> JobRecord:
    """A job record from its row: (state, fingerprint, result, fence, finished µs)."""
    state, fp, result, fence, finished_us = row
    return JobRecord(
        state=state,
        fingerprint=fp,
        result=result,
        fence=int(fence),
        finished_at=int(finished_us) / 1e6,
    )
