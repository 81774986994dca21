"""The Redlock grant as rounds: a majority's lock, its fence in one phase or two, the
clean-up of a grant that failed or was cancelled, and Busy with the holder's time left."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jobfence.locks.backend import Busy, JobRecord
from jobfence.locks.backends.redlock.protocol import NO_REPLY, ErrorReply
from jobfence.locks.backends.redlock.rounds import (
    SIGNAL_LIFETIME_MS,
    QuorumRounds,
    Round,
    Rounds,
    record_of,
)
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable, LockError
from jobfence.locks.lease import DRIFT_FLOOR, DRIFT_FRACTION, OwnerMeta

#: How far ahead of this host's clock a one-round proposal is made, in µs: it must clear the
#: masters' clocks plus the trip there, or the grant falls back to the second phase.
PROPOSAL_LEAD_US = 20_000
MARKED_KEYS_KEPT = 1024  # keys refused and not yet waited on, per client


@dataclass
class _Tally:
    """Phase one's replies, sorted by kind."""

    granted: dict[int, tuple[int, bool]]  # master -> (value, proposal accepted)
    busy: dict[int, list[Any]]
    done: dict[int, list[Any]]
    silent: list[int]  # no reply (down, broken, or still pending), or an error reply
    errors: list[str]  # the error replies among them


@dataclass
class _Attempt:
    """One grant attempt: who asks, its fence proposal, its validity, who answered last."""

    key: str
    owner: str
    proposal: int  # 0: none, the fence takes two phases
    retention: int  # ms a fence counter is kept
    valid_until: float  # the backend's clock
    deadline: float  # time.monotonic(): stop waiting for replies
    clock: Clock = SYSTEM_CLOCK
    # Masters that answered the last round: they owe nothing, so a release to them is
    # awaited; the others get it queued behind what they owe.
    answered: set[int] = field(default_factory=set)

    def valid(self) -> bool:
        return self.clock.monotonic() < self.valid_until

    def heard(self, replies: dict[int, Any]) -> None:
        for i, v in replies.items():
            if v is NO_REPLY:
                self.answered.discard(i)
            else:
                self.answered.add(i)


class GrantRounds(QuorumRounds):
    """The grant's flow (`begin_rounds`) and the wait's choice of master, for RedlockBackend."""

    clock: Clock
    one_round: bool
    fence_floor: int  # the highest fence granted to this client, on any key
    fence_retention_ms: int
    _lock: threading.Lock
    _marked: dict[str, int]
    _wait_on: int

    def begin_rounds(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> Rounds[int | Busy | JobRecord]:
        """A grant: the new fence, Busy, the job's record, or BackendUnavailable."""
        attempt = self._attempt(key, owner, ttl_ms)
        payload = self._begin_payload(attempt, ttl_ms, meta, record, fingerprint)
        try:
            tally = yield from self._phase_one(attempt, payload)
            return (yield from self._settle(attempt, tally, ttl_ms / 1000))
        except (Exception, GeneratorExit):
            raise  # decided here (released already), or a lost reply: lapses after its TTL
        except BaseException:
            # Cancelled or interrupted mid-grant: free the key on every master now, sent
            # behind the grant's commands on each connection (so it runs after them), not
            # waited for.
            yield self._release_round(attempt, None, 0.0)
            raise

    def _attempt(self, key: str, owner: str, ttl_ms: int) -> _Attempt:
        """A grant attempt starting now: its validity (the TTL less the drift allowance),
        its one-round fence proposal, and how long its fence counter is kept."""
        ttl = ttl_ms / 1000
        started = self.clock.monotonic()
        valid_until = started + ttl - (ttl * DRIFT_FRACTION + DRIFT_FLOOR)
        if valid_until <= started:
            raise LockError(
                f"ttl {ttl:g}s leaves no validity after the clock-drift allowance "
                f"(ttl x {DRIFT_FRACTION:g} + {DRIFT_FLOOR * 1000:g} ms); use a longer ttl",
                key=key,
            )
        proposal = 0
        if self.one_round:
            proposal = max(self.fence_floor + 1, time.time_ns() // 1000 + PROPOSAL_LEAD_US)
        return _Attempt(
            key=key,
            owner=owner,
            proposal=proposal,
            retention=max(self.fence_retention_ms, ttl_ms),
            valid_until=valid_until,
            # Replies later than the validity are no use: stop waiting for them then.
            deadline=time.monotonic() + min(self.socket_timeout, ttl),
            clock=self.clock,
        )

    def _begin_payload(
        self, attempt: _Attempt, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> bytes:
        """Phase one's script call: lock, propose the fence, and (`record`) read the record."""
        k, key = self.keys, attempt.key
        keys = [k.lock(key), k.fence(key)] + ([k.record(key)] if record else [])
        holder = f"{meta.host}\n{meta.pid}\n{meta.task_name}\n{meta.process_start}"
        return self._evalsha(
            "redlock_begin",
            keys,
            [attempt.owner, ttl_ms, attempt.retention, "1" if record else "0", meta.task_id,
             holder, fingerprint if record else "", attempt.proposal],
        )  # fmt: skip

    def _settle(
        self, attempt: _Attempt, tally: _Tally, ttl: float
    ) -> Rounds[int | Busy | JobRecord]:
        """Turn phase one's replies into a grant (after phase two if needed), the job's
        record, Busy, or BackendUnavailable; whatever is not a grant is released at once."""
        q, n = self.quorum, len(self.masters)
        ours = [*tally.granted, *tally.silent]  # masters that hold, or may hold, our key
        if len(tally.done) >= q:
            yield from self._release_on(attempt, ours)
            return record_of(max(tally.done.values(), key=lambda r: int(r[4] or 0)))
        if len(tally.granted) >= q and attempt.valid():
            fence = yield from self._fence(attempt, tally)
            if fence is not None and attempt.valid():
                with self._lock:
                    self.fence_floor = max(self.fence_floor, fence)
                return fence
            yield from self._release_on(attempt, ours)
            raise BackendUnavailable(
                f"redlock grant not confirmed by a majority within its validity ({n} masters, "
                f"ttl {ttl:g}s)",
                key=attempt.key,
            )
        yield from self._release_on(attempt, ours)
        if tally.busy and len(tally.busy) + len(tally.done) > n - q:
            self._note_marked(attempt.key, tally)
            return self._busy(tally)
        if len(tally.granted) >= q:
            raise BackendUnavailable(
                f"redlock acquire took longer than the lease's validity (ttl {ttl:g}s)",
                key=attempt.key,
            )
        detail = f" (a master said: {tally.errors[0]})" if tally.errors else ""
        raise BackendUnavailable(
            f"redlock acquire: {n - len(tally.silent)} of {n} masters answered, a majority "
            f"of {q} is needed{detail}{self._why(tally.errors, tally.silent)}",
            key=attempt.key,
        )

    def _phase_one(self, attempt: _Attempt, payload: bytes) -> Rounds[_Tally]:
        q, n = self.quorum, len(self.masters)

        def decided(replies: dict[int, Any], pending: int) -> bool:
            # Done when a majority granted or has the record, or when refusals alone rule
            # a majority out. Masters that do not answer are waited for (up to the
            # deadline): the error then says how many answered, and the clean-up knows
            # which masters to wait for.
            granted = done = refused = 0
            for v in replies.values():
                if type(v) is list:
                    if v[0] == 1:
                        granted += 1
                    else:
                        refused += 1
                        done += v[0] == 2
            return granted >= q or done >= q or refused > n - q or pending == 0

        replies = yield Round(payload, attempt.deadline, decided)
        attempt.heard(replies)
        tally = _Tally({}, {}, {}, [], [])
        for i in range(n):
            v = replies.get(i, NO_REPLY)
            if type(v) is not list:
                tally.silent.append(i)
                if isinstance(v, ErrorReply):
                    tally.errors.append(v)
            elif v[0] == 1:
                tally.granted[i] = (int(v[1]), bool(v[2]))
            elif v[0] == 0:
                tally.busy[i] = v
            else:
                tally.done[i] = v
        return tally

    def _fence(self, attempt: _Attempt, tally: _Tally) -> Rounds[int | None]:
        """The grant's fence once a majority carries it under our lock, else None."""
        proposal = attempt.proposal
        if proposal and all(accepted for _, accepted in tally.granted.values()):
            # Every master that locked took the proposal: phase two is done. A master that
            # has not answered yet will mostly take it too; if not, it holds our key without
            # the fence (never counted) until the release, queued behind on its connection.
            return proposal
        values = [value for value, _ in tally.granted.values()]
        fence = max([*values, proposal, self.fence_floor]) + 1
        k, key = self.keys, attempt.key
        payload = self._evalsha(
            "redlock_fence",
            [k.lock(key), k.fence(key), k.signal(key)],
            [attempt.owner, fence, attempt.retention, SIGNAL_LIFETIME_MS],
        )
        q = self.quorum

        def decided(replies: dict[int, Any], pending: int) -> bool:
            ok = sum(1 for v in replies.values() if v == 1)
            return ok >= q or ok + pending < q

        # Phase two goes to the silent masters too (queued behind phase one on their
        # connection): each ends in line with the grant, or without our key.
        targets = [*tally.granted, *tally.silent]
        replies = yield Round(payload, attempt.deadline, decided, targets)
        attempt.heard(replies)
        accepted = sum(1 for v in replies.values() if v == 1)
        return fence if accepted >= q else None

    def _release_on(self, attempt: _Attempt, masters: Sequence[int]) -> Rounds[None]:
        """Owner-checked release on `masters` at once; waits for those that answered the
        last round (the others get it queued behind what they owe)."""
        if masters:
            yield self._release_round(attempt, masters, self._io_deadline(time.monotonic()))

    def _release_round(
        self, attempt: _Attempt, masters: Sequence[int] | None, deadline: float
    ) -> Round:
        k, key = self.keys, attempt.key
        payload = self._evalsha(
            "release", [k.lock(key), k.signal(key)], [attempt.owner, SIGNAL_LIFETIME_MS]
        )
        live = attempt.answered.intersection(range(len(self.masters)) if masters is None
                                             else masters)  # fmt: skip

        def decided(replies: dict[int, Any], pending: int) -> bool:
            return live.issubset(replies)

        return Round(payload, deadline, decided, masters)

    def _note_marked(self, key: str, tally: _Tally) -> None:
        """Remember a master that refused `key` (so marked it waited on) for the wait."""
        default = self._wait_on % len(self.masters)
        index = default if default in tally.busy else next(iter(tally.busy))
        with self._lock:
            if len(self._marked) >= MARKED_KEYS_KEPT:  # refused, never waited (skip): forget
                self._marked.clear()
            self._marked[key] = index

    def wait_master(self, key: str) -> int:
        """The master a wait for `key`'s release blocks on: one that refused this client's
        last attempt (the release signals there), else the current default."""
        with self._lock:
            marked = self._marked.pop(key, None)
        return self._wait_on % len(self.masters) if marked is None else marked

    def _busy(self, tally: _Tally) -> Busy:
        # The holder's grant ends when enough of its masters expire for a majority to be
        # free: with `free` masters not held, that is the (quorum - free)-th expiry.
        free = len(self.masters) - len(tally.busy)
        ttls = sorted(
            float("inf") if int(v[1]) < 0 else int(v[1]) / 1000 for v in tally.busy.values()
        )
        nth = max(0, min(len(ttls) - 1, self.quorum - free - 1))
        (task_id, fingerprint), _ = Counter(
            (str(v[2] or ""), str(v[3] or "")) for v in tally.busy.values()
        ).most_common(1)[0]
        return Busy(ttl_left=ttls[nth], task_id=task_id, fingerprint=fingerprint)
