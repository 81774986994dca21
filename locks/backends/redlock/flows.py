"""Every Redlock op but the grant as rounds: extend, release, commit, inspect, the job's
record, the publish claim and swap, and the delivery count (each one round to every master)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from jobfence.locks.backend import CommitRecord, JobRecord, LockInfo
from jobfence.locks.backends.redlock.protocol import pack
from jobfence.locks.backends.redlock.rounds import (
    SIGNAL_LIFETIME_MS,
    QuorumRounds,
    Round,
    Rounds,
    is_answer,
    record_of,
    row_of,
)


class OpRounds(QuorumRounds):
    """The flows of RedlockBackend's ops other than the grant (grant.py), sync and asyncio."""

    # -- keeping and ending grants ---------------------------------------------------
    def extend_rounds(self, key: str, owner: str, ttl_ms: int) -> Rounds[bool]:
        payload = self._evalsha("extend", [self.keys.lock(key)], [owner, ttl_ms])
        replies = yield from self._everywhere(payload, ok=lambda v: v == 1)
        extended, silent = self._count(replies, lambda v: v == 1)
        if extended >= self.quorum:
            return True
        if len(self.masters) - silent < self.quorum:  # as in extend_many_rounds
            raise self._unavailable("extend", replies, key)
        return False

    def extend_many_rounds(self, items: Sequence[tuple[str, str, int]]) -> Rounds[list[bool]]:
        """Extend every (key, owner, ttl ms) in one round; which a majority extended."""
        args: list[Any] = []
        for _, owner, ttl_ms in items:
            args += [owner, ttl_ms]
        payload = self._evalsha("extend_many", [self.keys.lock(k) for k, _, _ in items], args)
        q, n = self.quorum, len(items)

        def tallies(replies: dict[int, Any]) -> list[int]:
            counts = [0] * n
            for v in replies.values():
                if type(v) is list and len(v) == n:
                    for j, x in enumerate(v):
                        counts[j] += x == 1
            return counts

        def decided(replies: dict[int, Any], pending: int) -> bool:
            return all(c >= q or c + pending < q for c in tallies(replies))

        replies = yield Round(payload, self._io_deadline(time.monotonic()), decided)
        # A lease lives while a majority holds it. With a majority of masters answering, one
        # held on fewer is lost (the silent rest cannot be extended either); with fewer
        # answering nothing can be told, and the keeper tries again.
        self._quorum_of("extend_many", replies, None, row_of(n))
        return [c >= q for c in tallies(replies)]

    def release_rounds(self, key: str, owner: str) -> Rounds[bool]:
        """Owner-checked release; True where a majority removed the key."""
        k = self.keys
        payload = self._evalsha(
            "release", [k.lock(key), k.signal(key)], [owner, SIGNAL_LIFETIME_MS]
        )
        return (yield from self._majority(payload, key, "release", lambda v: v == 1))

    def commit_rounds(self, rec: CommitRecord) -> Rounds[bool]:
        """Store the record and release where the owner still holds; True on a majority."""
        key, owner, fence, state, result, fingerprint, result_ttl_ms = rec
        k = self.keys
        payload = self._evalsha(
            "redlock_commit",
            [k.lock(key), k.record(key), k.signal(key)],
            [owner, state, result, fingerprint, fence, result_ttl_ms, SIGNAL_LIFETIME_MS,
             time.time_ns() // 1_000_000],
        )  # fmt: skip
        return (yield from self._majority(payload, key, "commit", lambda v: v == 1))

    # -- reading --------------------------------------------------------------------
    def inspect_rounds(self, key: str) -> Rounds[LockInfo | None]:
        """What a majority of masters shows of `key`'s holder (never the owner token)."""
        payload = self._evalsha("redlock_inspect", [self.keys.lock(key)], [])
        replies = yield from self._everywhere(payload)
        views = self._quorum_of("inspect", replies, key, row_of(6))
        by_fence: dict[str, list[list[Any]]] = {}
        for v in views:
            if v[0] is not None and int(v[5]) != -2:
                by_fence.setdefault(str(v[0]), []).append(v)
        held = [group for group in by_fence.values() if len(group) >= self.quorum]
        if not held:
            return None
        group = held[0]
        fence = int(group[0][0])
        # The lock holds while a majority of its copies live: the quorum-th longest TTL.
        ttls = sorted((max(0, int(v[5])) for v in group), reverse=True)
        first = min(group, key=lambda v: int(v[3] or 0))
        host, pid, task_name, started = [*str(first[2]).split("\n", 3), "", "", ""][:4]
        acquired = min(int(v[3] or 0) for v in group)
        beat = max(int(v[4] or v[3] or 0) for v in group)
        return LockInfo(
            key=key,
            fence=fence,
            ttl_left=ttls[self.quorum - 1] / 1000,
            host=host,
            pid=int(pid or 0),
            task_id=str(first[1]),
            task_name=task_name,
            acquired_at=acquired / 1000,
            last_heartbeat=beat / 1000,
            process_start=started,
        )

    def job_record_rounds(self, key: str) -> Rounds[JobRecord | None]:
        payload = pack(
            "HMGET", self.keys.record(key), "state", "fingerprint", "result", "fence", "finished_ms"
        )
        replies = yield from self._everywhere(payload)
        rows = [tuple(v) for v in self._quorum_of("job_record", replies, key, row_of(5))]
        for row, count in Counter(rows).most_common():
            if count >= self.quorum and row[0] in ("DONE", "FAILED"):
                return record_of([2, *row])
        return None

    def claim_publish_rounds(self, key: str, task_id: str, ttl: float) -> Rounds[str | None]:
        """Claim `key`'s publish for `task_id`; the holder a majority names, if another."""
        payload = self._evalsha(
            "claim_publish", [self.keys.queued(key)], [task_id, int(ttl * 1000)]
        )
        replies = yield from self._everywhere(payload)
        answers = self._quorum_of("claim_publish", replies, key, is_answer)
        held = Counter(str(v) for v in answers if v)
        if held:
            other, count = held.most_common(1)[0]
            if count >= self.quorum:
                return other
        return None

    def swap_publish_rounds(
        self, key: str, expect: str, new: str | None, ttl_ms: int
    ) -> Rounds[str | None]:
        """The swap on every master; done where a majority did it (a minority's swap
        expires with its TTL), else the value most of the refusing masters hold answers."""
        payload = self._evalsha(
            "swap_publish", [self.keys.queued(key)], [expect, new or "", ttl_ms]
        )
        replies = yield from self._everywhere(payload)
        answers = self._quorum_of("swap_publish", replies, key, is_answer)
        kept = Counter(str(v) for v in answers if v)
        if len(answers) - sum(kept.values()) >= self.quorum:
            return None
        return kept.most_common(1)[0][0]

    def clear_publish_rounds(self, key: str) -> Rounds[None]:
        payload = self._evalsha("redlock_admin", [self.keys.queued(key)], ["delete"])
        yield from self._majority(payload, key, "clear_publish", lambda v: isinstance(v, int))

    def count_delivery_rounds(self, key: str, window_ms: int) -> Rounds[int]:
        payload = self._evalsha("redlock_admin", [self.keys.deliveries(key)], ["count", window_ms])
        replies = yield from self._everywhere(payload)
        counts = self._quorum_of("count_delivery", replies, key, lambda v: type(v) is int)
        return int(max(counts))  # a master that lost its count must not reset the cap
