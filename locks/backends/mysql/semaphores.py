"""Semaphores on MySQL/MariaDB: a row per semaphore serialises grants; one round trip per call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobfence.locks.backends.mysql.statements import extend_many
from jobfence.locks.backends.mysql.tables import (
    NOW_US,
    SEMAPHORE_DDL,
    filled,
    key_hash,
    semaphore_tables,
)
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import OwnerMeta
from jobfence.locks.slots import SlotInfo, SlotWait, holder_text, parse_holder

_MINE = "key_hash = %(h)s AND owner = %(o)s"
_QUEUE = "NOT @jf_grant AND @jf_mine IS NULL AND %(q)s > 0"

# One attempt, in one transaction: purge the lapsed, grant if the slots free and the waiters
# ahead allow, else queue (for `q` µs); the last SELECT answers. Fields: the semaphore
# tables ({state}, {slots}, {waiters}) and the lock backend's {fence} counter.
ACQUIRE = ";".join(
    [
        "START TRANSACTION",
        # Locks the semaphore's row until COMMIT: attempts on one key take turns.
        "INSERT INTO {state} (key_hash, fence, ticket) VALUES (%(h)s, 0, 0)"
        " ON DUPLICATE KEY UPDATE fence = fence",
        "SET @jf_now = NOW(6)",
        "DELETE FROM {slots} WHERE key_hash = %(h)s AND expires_at <= @jf_now",
        "DELETE FROM {waiters} WHERE key_hash = %(h)s AND expires_at <= @jf_now",
        f"SET @jf_mine = (SELECT fence FROM {{slots}} WHERE {_MINE})",
        "SET @jf_held = (SELECT COUNT(*) FROM {slots} WHERE key_hash = %(h)s)",
        f"SET @jf_ticket = (SELECT ticket FROM {{waiters}} WHERE {_MINE})",
        "SET @jf_ahead = (SELECT COUNT(*) FROM {waiters} WHERE key_hash = %(h)s"
        " AND (@jf_ticket IS NULL OR ticket < @jf_ticket))",
        "SET @jf_grant = (@jf_mine IS NULL AND @jf_ahead < %(limit)s - @jf_held)",
        # The lock backend's fence counter (started at the server µs clock), then
        # this semaphore's own last fence and the client's floor (DESIGN §4).
        f"UPDATE {{fence}} SET v = GREATEST(v + 1, {NOW_US}, %(floor)s + 1)"
        " WHERE id = 1 AND @jf_grant",
        "UPDATE {state} SET fence = GREATEST(fence + 1, (SELECT v FROM {fence} WHERE id = 1),"
        f" {NOW_US}, %(floor)s + 1) WHERE key_hash = %(h)s AND @jf_grant",
        "INSERT INTO {slots} (key_hash, owner, fence, expires_at, heartbeat_at, holder)"
        " SELECT %(h)s, %(o)s, fence, @jf_now + INTERVAL %(ttl)s MICROSECOND, @jf_now,"
        " %(holder)s FROM {state} WHERE key_hash = %(h)s AND @jf_grant",
        f"DELETE FROM {{waiters}} WHERE {_MINE} AND @jf_grant",
        f"UPDATE {{state}} SET ticket = ticket + 1 WHERE key_hash = %(h)s AND {_QUEUE}"
        " AND @jf_ticket IS NULL",
        "INSERT INTO {waiters} (key_hash, owner, ticket, expires_at) SELECT %(h)s, %(o)s,"
        " ticket, @jf_now + INTERVAL %(q)s MICROSECOND"
        f" FROM {{state}} WHERE key_hash = %(h)s AND {_QUEUE}"
        " ON DUPLICATE KEY UPDATE expires_at = @jf_now + INTERVAL %(q)s MICROSECOND",
        f"SELECT @jf_grant, COALESCE(@jf_mine, (SELECT fence FROM {{slots}} WHERE {_MINE})),"
        " @jf_ahead, TIMESTAMPDIFF(MICROSECOND, @jf_now,"
        " (SELECT MIN(expires_at) FROM {slots} WHERE key_hash = %(h)s))",
        "COMMIT",
    ]
)

RELEASE = ";".join(
    [
        "START TRANSACTION",
        f"SET @jf_r = (SELECT COUNT(*) FROM {{slots}} WHERE {_MINE} AND expires_at > NOW(6))",
        f"DELETE FROM {{slots}} WHERE {_MINE}",
        f"DELETE FROM {{waiters}} WHERE {_MINE}",
        "COMMIT",
        "SELECT @jf_r",
    ]
)

HOLDERS = (
    "SELECT fence, TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at), holder FROM {slots}"
    " WHERE key_hash = %s AND expires_at > NOW(6)"
)


class MySQLSemaphores:
    """The semaphore half of MySQLBackend (mixed in): tables of its own, made on first use."""

    prefix: str
    tables: dict[str, str]
    fence_floor: int
    _sem_ready: bool = False

    def _run(self, sql: str, params: Any, key: str | None) -> list[Any]:
        raise NotImplementedError  # MySQLBackend's

    def _sem_sql(self, template: str) -> str:
        """`template` with the semaphore tables' names (and the fence counter's) filled in;
        the tables made first where this client has not yet."""
        if not self._sem_ready:
            self.create_semaphore_tables()
        return template.format(**semaphore_tables(self.prefix), fence=self.tables["fence"])

    def create_semaphore_tables(self) -> None:
        """Create the semaphore tables where missing (safe to repeat)."""
        for stmt in filled(SEMAPHORE_DDL, semaphore_tables(self.prefix)):
            for attempt in (0, 1):
                try:
                    self._run(stmt, None, None)
                    break
                except BackendUnavailable:  # a racing creator (1050): once more
                    if attempt:
                        raise
        self._sem_ready = True

    def _sem_acquire(
        self, key: str, owner: str, limit: int, ttl_ms: int, queue_ms: int, meta: OwnerMeta
    ) -> int | SlotWait:
        params = {"h": key_hash(key), "o": owner, "limit": limit, "ttl": ttl_ms * 1000,
                  "q": queue_ms * 1000, "floor": self.fence_floor,
                  "holder": holder_text(meta)}  # fmt: skip
        sets = self._run(self._sem_sql(ACQUIRE), params, key)
        _, fence, ahead, first_us = [s for s in sets if isinstance(s, list)][-1][0]
        if fence is not None:  # held by this owner: granted now, or a repeat of a grant
            got = int(fence)
            if got > self.fence_floor:
                self.fence_floor = got
            return got
        return SlotWait(
            position=int(ahead) if queue_ms else -1,
            ttl_left=max(0, int(first_us or 0)) / 1e6,
        )

    def _sem_extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        return extend_many(self._run, self._sem_sql("{slots}"), items)

    def _sem_release(self, key: str, owner: str) -> bool:
        sets = self._run(self._sem_sql(RELEASE), {"h": key_hash(key), "o": owner}, key)
        return bool(sets[-1][0][0])

    def _sem_holders(self, key: str) -> list[SlotInfo]:
        rows = self._run(self._sem_sql(HOLDERS), (key_hash(key),), key)[0]
        return [parse_holder(int(f), int(us) / 1e6, h) for f, us, h in rows]
