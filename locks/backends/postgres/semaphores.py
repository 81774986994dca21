"""Semaphores on PostgreSQL: a row per semaphore serialises grants; slots and waiters are rows."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from typing import Any, ClassVar

import psycopg
from psycopg import errors as pgerrors

from jobfence.locks.backends.postgres.connection import creators_wait, tables_exist
from jobfence.locks.backends.postgres.protocol import extend_params, parse_extend
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import OwnerMeta
from jobfence.locks.slots import SlotInfo, SlotWait, holder_text, parse_holder

SEMAPHORES = "jobfence_semaphores"
SLOTS = "jobfence_semaphore_slots"
WAITERS = "jobfence_semaphore_waiters"

SEMAPHORE_DDL = [
    f"""CREATE TABLE IF NOT EXISTS {SEMAPHORES} (
  prefix text NOT NULL, key text NOT NULL, fence bigint NOT NULL DEFAULT 0,
  PRIMARY KEY (prefix, key))""",
    f"""CREATE TABLE IF NOT EXISTS {SLOTS} (
  prefix text NOT NULL, key text NOT NULL, owner text NOT NULL, fence bigint NOT NULL,
  expires_at timestamptz NOT NULL, holder text NOT NULL DEFAULT '',
  PRIMARY KEY (prefix, key, owner))""",
    # Waiters in arrival order: ids come from a sequence while the semaphore's row is
    # locked, so they increase in the order the grants are serialised.
    f"""CREATE TABLE IF NOT EXISTS {WAITERS} (
  id bigserial PRIMARY KEY, prefix text NOT NULL, key text NOT NULL, owner text NOT NULL,
  expires_at timestamptz NOT NULL, UNIQUE (prefix, key, owner))""",
]

# Locks the semaphore's row for the transaction (made on first use) and reads the clock
# once: every decision of the attempt is made at this instant.
_LOCK = f"""INSERT INTO {SEMAPHORES} AS s (prefix, key) VALUES (%s, %s)
ON CONFLICT (prefix, key) DO UPDATE SET fence = s.fence RETURNING clock_timestamp()"""

_PURGE = f"""WITH gone AS (DELETE FROM {SLOTS}
  WHERE prefix = %(prefix)s AND key = %(key)s AND expires_at <= %(now)s RETURNING 1),
lapsed AS (DELETE FROM {WAITERS}
  WHERE prefix = %(prefix)s AND key = %(key)s AND expires_at <= %(now)s RETURNING 1)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM lapsed)"""

# Read after the purge commits inside this transaction (read committed: a new snapshot).
_STATE = f"""SELECT
  (SELECT count(*) FROM {SLOTS} WHERE prefix = %(prefix)s AND key = %(key)s),
  (SELECT fence FROM {SLOTS} WHERE prefix = %(prefix)s AND key = %(key)s AND owner = %(owner)s),
  (SELECT id FROM {WAITERS} WHERE prefix = %(prefix)s AND key = %(key)s AND owner = %(owner)s),
  (SELECT count(*) FROM {WAITERS} w WHERE w.prefix = %(prefix)s AND w.key = %(key)s
     AND w.id < coalesce((SELECT id FROM {WAITERS} WHERE prefix = %(prefix)s
       AND key = %(key)s AND owner = %(owner)s), 9223372036854775807)),
  (SELECT extract(epoch FROM min(expires_at) - %(now)s)::float8 FROM {SLOTS}
     WHERE prefix = %(prefix)s AND key = %(key)s)"""

# The fence: the lock backend's own source (sequence started at the server µs clock), never
# below the clock, the semaphore's last fence or this client's floor (DESIGN §4).
_GRANT = f"""WITH f AS (UPDATE {SEMAPHORES} SET fence = greatest(nextval(%(sequence)s::regclass),
    (extract(epoch FROM %(now)s::timestamptz) * 1000000)::bigint, fence + 1, %(floor)s + 1)
  WHERE prefix = %(prefix)s AND key = %(key)s RETURNING fence),
w AS (DELETE FROM {WAITERS} WHERE prefix = %(prefix)s AND key = %(key)s AND owner = %(owner)s)
INSERT INTO {SLOTS} (prefix, key, owner, fence, expires_at, holder)
SELECT %(prefix)s, %(key)s, %(owner)s, f.fence,
  %(now)s::timestamptz + %(ttl)s * interval '1 millisecond', %(holder)s FROM f
RETURNING fence"""

_QUEUE = f"""INSERT INTO {WAITERS} AS w (prefix, key, owner, expires_at)
VALUES (%(prefix)s, %(key)s, %(owner)s, %(now)s::timestamptz + %(queue)s * interval '1 millisecond')
ON CONFLICT (prefix, key, owner) DO UPDATE SET expires_at = excluded.expires_at"""

_EXTEND_MANY = f"""UPDATE {SLOTS} s
SET expires_at = clock_timestamp() + v.ttl * interval '1 millisecond'
FROM unnest(%s::text[], %s::text[], %s::int[]) AS v(key, owner, ttl)
WHERE s.prefix = %s AND s.key = v.key AND s.owner = v.owner
  AND s.expires_at > clock_timestamp()
RETURNING s.key, s.owner"""

_RELEASE = f"""WITH w AS (DELETE FROM {WAITERS}
  WHERE prefix = %(prefix)s AND key = %(key)s AND owner = %(owner)s)
DELETE FROM {SLOTS} WHERE prefix = %(prefix)s AND key = %(key)s AND owner = %(owner)s
RETURNING expires_at > clock_timestamp()"""

_HOLDERS = f"""SELECT fence, extract(epoch FROM expires_at - clock_timestamp())::float8, holder
FROM {SLOTS} WHERE prefix = %s AND key = %s AND expires_at > clock_timestamp()"""


class PostgresSemaphores:
    """The semaphore half of PostgresBackend (mixed in): tables of its own, made on first use."""

    prefix: str
    fence_floor: int
    statements: int
    _ready: bool
    _sem_ready: bool = False
    fence_sequence: ClassVar[str]

    def _conn(self, what: str, key: str | None) -> AbstractContextManager[psycopg.Connection[Any]]:
        raise NotImplementedError  # PostgresBackend's

    def create_tables(self) -> None:
        raise NotImplementedError  # PostgresBackend's

    def _run(self, what: str, key: str | None, sql: str, params: Any) -> list[tuple[Any, ...]]:
        raise NotImplementedError  # PostgresBackend's

    def create_semaphore_tables(self) -> None:
        """Create the semaphore tables where missing (safe to repeat)."""
        if not self._ready:
            self.create_tables()  # the fence sequence
        with self._conn("create semaphore tables", None) as conn:
            if not tables_exist(conn, (SEMAPHORES, SLOTS, WAITERS)):
                with conn.transaction():
                    creators_wait(conn, SEMAPHORES)
                    for stmt in SEMAPHORE_DDL:
                        conn.execute(stmt)
        self._sem_ready = True

    @contextmanager
    def _sem_transaction(self, what: str, key: str) -> Iterator[psycopg.Connection[Any]]:
        if not self._sem_ready:
            self.create_semaphore_tables()
        with self._conn(what, key) as conn, conn.transaction():
            yield conn

    def _sem_acquire(
        self, key: str, owner: str, limit: int, ttl_ms: int, queue_ms: int, meta: OwnerMeta
    ) -> int | SlotWait:
        try:
            return self._sem_acquire_once(key, owner, limit, ttl_ms, queue_ms, meta)
        except BackendUnavailable as exc:
            # A table or the fence sequence vanished (a restore without them): make them
            # again and try once more; the transaction rolled back whole.
            if not isinstance(exc.cause, pgerrors.UndefinedTable):
                raise
            self._ready = self._sem_ready = False
            return self._sem_acquire_once(key, owner, limit, ttl_ms, queue_ms, meta)

    def _sem_acquire_once(
        self, key: str, owner: str, limit: int, ttl_ms: int, queue_ms: int, meta: OwnerMeta
    ) -> int | SlotWait:
        with self._sem_transaction("semaphore acquire", key) as conn:
            now: datetime = conn.execute(_LOCK, (self.prefix, key)).fetchone()[0]  # type: ignore[index]
            p = {"prefix": self.prefix, "key": key, "owner": owner, "now": now}
            conn.execute(_PURGE, p)
            held, mine, _, ahead, first = conn.execute(_STATE, p).fetchone()  # type: ignore[misc]
            self.statements += 3
            if mine is not None:  # a repeat of a grant whose answer was lost
                return int(mine)
            # (`ahead` of an owner not queued counts every waiter: none is overtaken.)
            if ahead < limit - held:
                p.update(sequence=self.fence_sequence, floor=self.fence_floor, ttl=ttl_ms,
                         holder=holder_text(meta))  # fmt: skip
                fence = int(conn.execute(_GRANT, p).fetchone()[0])  # type: ignore[index]
                self.statements += 1
                if fence > self.fence_floor:
                    self.fence_floor = fence
                return fence
            position = -1
            if queue_ms:
                p["queue"] = queue_ms
                conn.execute(_QUEUE, p)
                self.statements += 1
                position = int(ahead)
            return SlotWait(position=position, ttl_left=max(0.0, float(first or 0.0)))

    def _sem_extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        if not self._sem_ready:
            self.create_semaphore_tables()
        rows = self._run("semaphore extend_many", None, _EXTEND_MANY,
                         extend_params(self.prefix, items))  # fmt: skip
        return parse_extend(items, rows)

    def _sem_release(self, key: str, owner: str) -> bool:
        if not self._sem_ready:
            self.create_semaphore_tables()
        rows = self._run("semaphore release", key, _RELEASE,
                         {"prefix": self.prefix, "key": key, "owner": owner})  # fmt: skip
        return bool(rows and rows[0][0] is True)

    def _sem_holders(self, key: str) -> list[SlotInfo]:
        if not self._sem_ready:
            self.create_semaphore_tables()
        rows = self._run("semaphore holders", key, _HOLDERS, (self.prefix, key))
        return [parse_holder(int(f), float(left), holder) for f, left, holder in rows]
