"""Semaphores on MySQL/MariaDB: a row per semaphore serialises grants; one round trip per call."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import OwnerMeta
from jobfence.locks.slots import SlotInfo, SlotWait, holder_text, parse_holder

NOW_US = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', NOW(6))"


def key_hash(key: str) -> str:
    """The primary key of `key`'s rows: SHA-256 hex (keys run to 512 characters)."""
    return hashlib.sha256(key.encode()).hexdigest()


def extend_many(
    run: Callable[[str, Any, str | None], Any],
    table: str,
    items: Sequence[tuple[str, str, int]],
    *,
    by_key: bool = False,
) -> list[bool]:
    """Extend the leases `items` ((key, owner, ttl ms)) held in `table` (the locks', or a
    semaphore's slots) in one round trip of `run`; whether each is still held. `by_key`:
    the WHERE names the key hashes alone too (the locks table's primary key).

    One stamp for the batch: the rows extended now carry it, so the SELECT after the
    UPDATE (same round trip) names exactly them. Owner tokens are unique per lease."""
    hashes = [key_hash(k) for k, _, _ in items]
    pairs = ", ".join(["(%s, %s)"] * len(items))
    case = " ".join(["WHEN %s THEN %s"] * len(items))
    keyed = f"key_hash IN ({', '.join(['%s'] * len(items))}) AND " if by_key else ""
    sql = ";".join(
        [
            "SET @jf_t = NOW(6)",
            f"UPDATE {table} SET heartbeat_at = @jf_t, expires_at = @jf_t + INTERVAL"
            f" (CASE owner {case} END) MICROSECOND WHERE {keyed}(key_hash, owner) IN ({pairs})"
            " AND expires_at > @jf_t",
            f"SELECT key_hash, owner FROM {table} WHERE {keyed}(key_hash, owner) IN ({pairs})"
            " AND heartbeat_at = @jf_t",
        ]
    )
    flat = [x for h, (_, o, _) in zip(hashes, items, strict=True) for x in (h, o)]
    params: list[Any] = [x for _, o, t in items for x in (o, t * 1000)]
    params += [*(hashes if by_key else []), *flat] * 2
    sets = run(sql, params, None)
    done = {(h, o) for h, o in sets[2]}
    return [(h, o) in done for h, (_, o, _) in zip(hashes, items, strict=True)]


def semaphore_ddl(state: str, slots: str, waiters: str) -> list[str]:
    key = "key_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL"
    owner = "owner CHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL"
    return [
        f"""CREATE TABLE IF NOT EXISTS {state} (
  {key} PRIMARY KEY, fence BIGINT UNSIGNED NOT NULL, ticket BIGINT UNSIGNED NOT NULL
) ENGINE=InnoDB""",
        f"""CREATE TABLE IF NOT EXISTS {slots} (
  {key}, {owner}, fence BIGINT UNSIGNED NOT NULL, expires_at DATETIME(6) NOT NULL,
  heartbeat_at DATETIME(6) NOT NULL,
  holder TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  PRIMARY KEY (key_hash, owner)
) ENGINE=InnoDB""",
        # Waiters in ticket order: tickets are drawn from the semaphore's row while it is
        # locked, so they increase in the order attempts are serialised.
        f"""CREATE TABLE IF NOT EXISTS {waiters} (
  {key}, {owner}, ticket BIGINT UNSIGNED NOT NULL, expires_at DATETIME(6) NOT NULL,
  PRIMARY KEY (key_hash, owner), KEY (key_hash, ticket)
) ENGINE=InnoDB""",
    ]


class MySQLSemaphores:
    """The semaphore half of MySQLBackend (mixed in): tables of its own, made on first use."""

    prefix: str
    tables: dict[str, str]
    fence_floor: int
    _sem_ready: bool = False

    def _run(self, sql: str, params: Any, key: str | None) -> list[Any]:
        raise NotImplementedError  # MySQLBackend's

    def _sem_tables(self) -> tuple[str, str, str]:
        return tuple(  # type: ignore[return-value]
            "`" + f"{self.prefix}_sem_{n}".replace("`", "``") + "`"
            for n in ("state", "slots", "waiters")
        )

    def create_semaphore_tables(self) -> None:
        """Create the semaphore tables where missing (safe to repeat)."""
        for stmt in semaphore_ddl(*self._sem_tables()):
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
        if not self._sem_ready:
            self.create_semaphore_tables()
        st, sl, wt = self._sem_tables()
        fc = self.tables["fence"]
        mine = "key_hash = %(h)s AND owner = %(o)s"
        queue = "NOT @jf_grant AND @jf_mine IS NULL AND %(q)s > 0"
        sql = ";".join(
            [
                "START TRANSACTION",
                # Locks the semaphore's row until COMMIT: attempts on one key take turns.
                f"INSERT INTO {st} (key_hash, fence, ticket) VALUES (%(h)s, 0, 0)"
                " ON DUPLICATE KEY UPDATE fence = fence",
                "SET @jf_now = NOW(6)",
                f"DELETE FROM {sl} WHERE key_hash = %(h)s AND expires_at <= @jf_now",
                f"DELETE FROM {wt} WHERE key_hash = %(h)s AND expires_at <= @jf_now",
                f"SET @jf_mine = (SELECT fence FROM {sl} WHERE {mine})",
                f"SET @jf_held = (SELECT COUNT(*) FROM {sl} WHERE key_hash = %(h)s)",
                f"SET @jf_ticket = (SELECT ticket FROM {wt} WHERE {mine})",
                f"SET @jf_ahead = (SELECT COUNT(*) FROM {wt} WHERE key_hash = %(h)s"
                " AND (@jf_ticket IS NULL OR ticket < @jf_ticket))",
                "SET @jf_grant = (@jf_mine IS NULL AND @jf_ahead < %(limit)s - @jf_held)",
                # The lock backend's fence counter (started at the server µs clock), then
                # this semaphore's own last fence and the client's floor (DESIGN §4).
                f"UPDATE {fc} SET v = GREATEST(v + 1, {NOW_US}, %(floor)s + 1)"
                " WHERE id = 1 AND @jf_grant",
                f"UPDATE {st} SET fence = GREATEST(fence + 1, (SELECT v FROM {fc} WHERE id = 1),"
                f" {NOW_US}, %(floor)s + 1) WHERE key_hash = %(h)s AND @jf_grant",
                f"INSERT INTO {sl} (key_hash, owner, fence, expires_at, heartbeat_at, holder)"
                " SELECT %(h)s, %(o)s, fence, @jf_now + INTERVAL %(ttl)s MICROSECOND, @jf_now,"
                f" %(holder)s FROM {st} WHERE key_hash = %(h)s AND @jf_grant",
                f"DELETE FROM {wt} WHERE {mine} AND @jf_grant",
                f"UPDATE {st} SET ticket = ticket + 1 WHERE key_hash = %(h)s AND {queue}"
                " AND @jf_ticket IS NULL",
                f"INSERT INTO {wt} (key_hash, owner, ticket, expires_at) SELECT %(h)s, %(o)s,"
                " ticket, @jf_now + INTERVAL %(q)s MICROSECOND"
                f" FROM {st} WHERE key_hash = %(h)s AND {queue}"
                " ON DUPLICATE KEY UPDATE expires_at = @jf_now + INTERVAL %(q)s MICROSECOND",
                f"SELECT @jf_grant, COALESCE(@jf_mine, (SELECT fence FROM {sl} WHERE {mine})),"
                " @jf_ahead, TIMESTAMPDIFF(MICROSECOND, @jf_now,"
                f" (SELECT MIN(expires_at) FROM {sl} WHERE key_hash = %(h)s))",
                "COMMIT",
            ]
        )
        params = {"h": key_hash(key), "o": owner, "limit": limit, "ttl": ttl_ms * 1000,
                  "q": queue_ms * 1000, "floor": self.fence_floor,
                  "holder": holder_text(meta)}  # fmt: skip
        sets = self._run(sql, params, key)
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
        if not self._sem_ready:
            self.create_semaphore_tables()
        _, sl, _ = self._sem_tables()
        return extend_many(self._run, sl, items)

    def _sem_release(self, key: str, owner: str) -> bool:
        if not self._sem_ready:
            self.create_semaphore_tables()
        _, sl, wt = self._sem_tables()
        mine = "key_hash = %(h)s AND owner = %(o)s"
        sql = ";".join(
            [
                "START TRANSACTION",
                f"SET @jf_r = (SELECT COUNT(*) FROM {sl} WHERE {mine} AND expires_at > NOW(6))",
                f"DELETE FROM {sl} WHERE {mine}",
                f"DELETE FROM {wt} WHERE {mine}",
                "COMMIT",
                "SELECT @jf_r",
            ]
        )
        sets = self._run(sql, {"h": key_hash(key), "o": owner}, key)
        return bool(sets[-1][0][0])

    def _sem_holders(self, key: str) -> list[SlotInfo]:
        if not self._sem_ready:
            self.create_semaphore_tables()
        _, sl, _ = self._sem_tables()
        rows = self._run(
            f"SELECT fence, TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at), holder FROM {sl}"
            " WHERE key_hash = %s AND expires_at > NOW(6)",
            (key_hash(key),),
            key,
        )[0]
        return [parse_holder(int(f), int(us) / 1e6, h) for f, us, h in rows]
