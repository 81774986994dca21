"""The decision log: why each delivery of a job ran or not, kept per key and bounded in total.

A store capability (`LockBackend.decision_log(bounds)`): Redis keeps the decisions worth
explaining (a skip, a conflict, a replay, a failure, ...) in a capped stream per job key with
a TTL, and one capped index stream (key and task id) so a task id finds its key; a routine
decision (a job that started and finished) goes into the index alone, so a finished job
leaves no key of its own besides its record; `memory://` keeps an in-process ring. Other
backends keep none (the structured log line per decision, `jobfence.decisions`, is written
on every backend). An entry holds the job key (`<task name>:<hmac>`), the task's name and id,
fences and fixed phrases: never an argument, an owner token or a secret.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from jobfence.locks.errors import BackendUnavailable

if TYPE_CHECKING:
    import redis

    from jobfence.locks.keys import KeySpace

#: Events of a job that runs normally: logged at DEBUG, the others at INFO.
ROUTINE = frozenset({"started", "done", "released"})


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision about one delivery of a job."""

    at: float  # Unix seconds
    event: str  # started, done, conflict, superseded, stale, redeliver, ... (tasks/events.py)
    key: str  # the job key, `<task name>:<hmac>`: never the arguments
    task_name: str
    task_id: str
    fence: int | None = None  # this delivery's fence, where it had one
    holder: str = ""  # the other task's id (the copy holding the key, the newer publish)
    newer: int | None = None  # stale: the fence the resource had accepted already
    reason: str = ""  # a fixed phrase: the conflict policy, why a redelivery


@dataclass(frozen=True)
class DecisionBounds:
    """How much the log keeps: `per_key` decisions of each key, `total` index entries (the
    ring's decisions), each for `ttl` seconds after the key's last decision."""

    per_key: int = 50
    total: int = 10_000
    ttl: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        if self.per_key < 1 or self.total < self.per_key or not self.ttl > 0:
            raise ValueError(
                f"decision log bounds need 1 <= per_key <= total and ttl > 0, got "
                f"per_key={self.per_key} total={self.total} ttl={self.ttl}"
            )


class DecisionLog(ABC):
    """Where a store keeps decisions. Appends come batched: one call per delivery."""

    where: ClassVar[str]  # for messages: what keeps the log

    def __init__(self, bounds: DecisionBounds) -> None:
        self.bounds = bounds

    def append(self, entry: Decision) -> None:
        self.append_many((entry,))

    @abstractmethod
    def append_many(self, entries: Sequence[Decision]) -> None:
        """Store `entries` in one round trip; BackendUnavailable if the store failed."""

    @abstractmethod
    def for_key(self, key: str, n: int = 50) -> list[Decision]:
        """The key's last `n` decisions, oldest first."""

    @abstractmethod
    def for_task(self, task_id: str, n: int = 50) -> list[Decision]:
        """Every kept decision of the keys `task_id` had decisions on (its own and the other
        deliveries' on those keys), the last `n`, oldest first."""


class RingDecisionLog(DecisionLog):
    """In-process, for memory://: a deque per key, the least recently written key evicted
    once `total` decisions are kept; a key's decisions expire `ttl` after its last one."""

    where: ClassVar[str] = "an in-process ring"

    def __init__(self, bounds: DecisionBounds, *, clock: Any = time.time) -> None:
        super().__init__(bounds)
        self._clock = clock
        self._keys: OrderedDict[str, tuple[deque[Decision], float]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()
        # The child's copy of a lock the parent's writer held mid-batch stays held for ever.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (r := ref()) and r._forked())  # type: ignore[func-returns-value]

    def _forked(self) -> None:
        self._lock = threading.Lock()

    def append_many(self, entries: Sequence[Decision]) -> None:
        expires = self._clock() + self.bounds.ttl
        with self._lock:
            for entry in entries:
                ring, _ = self._keys.pop(entry.key, (None, 0.0))
                if ring is None:
                    ring = deque(maxlen=self.bounds.per_key)
                self._count -= len(ring)
                ring.append(entry)
                self._count += len(ring)
                self._keys[entry.key] = (ring, expires)
            while self._count > self.bounds.total:
                _, (oldest, _) = self._keys.popitem(last=False)
                self._count -= len(oldest)

    def _live(self, key: str) -> list[Decision]:
        ring, expires = self._keys.get(key, (None, 0.0))
        return list(ring) if ring is not None and expires > self._clock() else []

    def for_key(self, key: str, n: int = 50) -> list[Decision]:
        with self._lock:
            return self._live(key)[-n:]

    def for_task(self, task_id: str, n: int = 50) -> list[Decision]:
        with self._lock:
            keys = [k for k, (ring, _) in self._keys.items() if any(d.task_id == task_id
                                                                   for d in ring)]  # fmt: skip
            found = [d for k in keys for d in self._live(k)]
        return sorted(found, key=lambda d: d.at)[-n:]


# Stream entry fields, one letter each: a log of millions of entries pays for long names.
_FIELDS = (("e", "event"), ("n", "task_name"), ("t", "task_id"), ("h", "holder"),
           ("r", "reason"))  # fmt: skip


def _encode(d: Decision) -> dict[str, Any]:
    fields: dict[str, Any] = {"a": int(d.at * 1000)}
    for short, name in _FIELDS:
        value = getattr(d, name)
        if value:
            fields[short] = value
    if d.fence is not None:
        fields["f"] = d.fence
    if d.newer is not None:
        fields["w"] = d.newer
    return fields


def _decode(key: str, fields: dict[str, str]) -> Decision:
    fence, newer = fields.get("f"), fields.get("w")
    return Decision(
        at=int(fields.get("a", 0)) / 1000,
        event=fields.get("e", ""),
        key=key,
        task_name=fields.get("n", ""),
        task_id=fields.get("t", ""),
        fence=int(fence) if fence else None,
        holder=fields.get("h", ""),
        newer=int(newer) if newer else None,
        reason=fields.get("r", ""),
    )


class RedisDecisionLog(DecisionLog):
    """A capped stream per job key (`<prefix>:decisions:{key}`, XADD MAXLEN per_key, expiring
    `ttl` after its last decision) for the decisions worth explaining, and an index stream
    (`<prefix>:decisions`, MAXLEN ~ total, the same TTL) that names the key and task id of
    each, and holds a routine decision (ROUTINE: started, done, released) whole, in place of
    a stream of the key's own: a job that runs and finishes leaves its record and no other
    key (a stream per finished job, kept `ttl`, cost several times the record's bytes), and
    the fleet's recent runs stay in the index, bounded in total. A key's decisions are its
    stream's and the index's that name it, merged by time.

    A batch goes in one round trip: one script call (decisions_append.lua) where the backend
    can run one over all the batch's keys, else the commands pipelined (a Cluster: the keys
    live in other slots)."""

    where: ClassVar[str] = "Redis streams"

    def __init__(
        self,
        client: redis.Redis,
        keys: KeySpace,
        bounds: DecisionBounds,
        *,
        send_many: Callable[[Sequence[tuple[Any, ...]]], list[Any]] | None = None,
        script: Callable[[list[str], list[Any]], Any] | None = None,
    ) -> None:
        super().__init__(bounds)
        self.client = client
        self.keys = keys
        self.script = script
        # The backend's lane (raw commands, one write, one read) where it has one: a
        # redis-py pipeline costs more in Python than the round trip on a loopback server.
        self.send_many = send_many or self._pipelined

    def _index_entries(self, entries: Sequence[Decision]) -> list[list[Any]]:
        """The index's entries for `entries`, as field lists: a routine decision whole (its
        key and its fields), the others a (key, task id) pointer each, once per batch."""
        out: list[list[Any]] = []
        pairs: dict[tuple[str, str], None] = {}
        for d in entries:
            if d.event in ROUTINE:
                out.append(["k", d.key, *(part for item in _encode(d).items() for part in item)])
            elif (d.key, d.task_id) not in pairs:
                pairs[(d.key, d.task_id)] = None
                out.append(["k", d.key, "t", d.task_id])
        return out

    def commands(self, entries: Sequence[Decision]) -> list[tuple[Any, ...]]:
        """XADD each decision worth explaining to its key's stream (exact MAXLEN: a few dozen
        entries) and renew each stream's TTL; XADD the index's entries (MAXLEN ~), renew its
        TTL."""
        b = self.bounds
        ttl_ms = int(b.ttl * 1000)
        index = self.keys.decision_index()
        out: list[tuple[Any, ...]] = []
        streams: dict[str, None] = {}
        for d in entries:
            if d.event in ROUTINE:
                continue
            stream = self.keys.decisions(d.key)
            fields = [part for item in _encode(d).items() for part in item]
            out.append(("XADD", stream, "MAXLEN", b.per_key, "*", *fields))
            streams[stream] = None
        out.extend(("PEXPIRE", stream, ttl_ms) for stream in streams)
        out.extend(("XADD", index, "MAXLEN", "~", b.total, "*", *fields)
                   for fields in self._index_entries(entries))  # fmt: skip
        out.append(("PEXPIRE", index, ttl_ms))
        return out

    def script_call(self, entries: Sequence[Decision]) -> tuple[list[str], list[Any]]:
        """decisions_append.lua's keys and arguments for `entries` (see the script)."""
        b = self.bounds
        index = self.keys.decision_index()
        keys: list[str] = [index]
        place: dict[str, int] = {}
        explained = [d for d in entries if d.event not in ROUTINE]
        args: list[Any] = [b.per_key, b.total, int(b.ttl * 1000), len(explained)]
        for d in explained:
            stream = self.keys.decisions(d.key)
            at = place.get(stream)
            if at is None:
                keys.append(stream)
                at = place[stream] = len(keys)  # Lua counts from 1
            fields = [part for item in _encode(d).items() for part in item]
            args.extend((at, len(fields), *fields))
        for fields in self._index_entries(entries):
            args.extend((len(fields), *fields))
        return keys, args

    def append_many(self, entries: Sequence[Decision]) -> None:
        if not entries:
            return
        from redis.exceptions import RedisError

        if self.script is not None:  # raises BackendUnavailable itself
            self.script(*self.script_call(entries))
            return
        try:
            self.send_many(self.commands(entries))
        except RedisError as exc:
            raise BackendUnavailable("redis decision log append failed", cause=exc) from exc

    def _pipelined(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        with self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)  # type: ignore[no-untyped-call]
            return list(pipe.execute())

    def _rows(self, stream: str, n: int) -> list[tuple[Any, dict[str, str]]]:
        """The last `n` entries of `stream`, newest first, fields as text."""
        from redis.exceptions import RedisError

        try:
            rows: Any = self.client.xrevrange(stream, count=n)
        except RedisError as exc:
            raise BackendUnavailable("redis decision log read failed", cause=exc) from exc
        return [(entry_id, {_text(k): _text(v) for k, v in (fields or {}).items()})
                for entry_id, fields in rows or ()]  # fmt: skip

    def _index(self) -> list[dict[str, str]]:
        """The index's entries, newest first (at most `total`, a capped stream)."""
        return [fields for _, fields in self._rows(self.keys.decision_index(), self.bounds.total)]

    def _merged(self, key: str, index: list[dict[str, str]], n: int) -> list[Decision]:
        """The key's stream and the index's whole decisions on it, the last `n` by time."""
        rows = self._rows(self.keys.decisions(key), n)
        found = [_decode(key, fields) for _, fields in reversed(rows)]
        found += [_decode(key, f) for f in reversed(index) if f.get("k") == key and f.get("e")]
        return sorted(found, key=lambda d: d.at)[-n:]  # stable: written order within a ms

    def for_key(self, key: str, n: int = 50) -> list[Decision]:
        return self._merged(key, self._index(), n)

    def keys_of(self, task_id: str) -> list[str]:
        """The job keys the index names for `task_id`, most recent first."""
        return self._keys_of(task_id, self._index())

    @staticmethod
    def _keys_of(task_id: str, index: list[dict[str, str]]) -> list[str]:
        found: dict[str, None] = {}
        for fields in index:
            if fields.get("t") == task_id and fields.get("k"):
                found[fields["k"]] = None
        return list(found)

    def for_task(self, task_id: str, n: int = 50) -> list[Decision]:
        index = self._index()
        found = [d for key in self._keys_of(task_id, index)
                 for d in self._merged(key, index, self.bounds.per_key)]  # fmt: skip
        return sorted(found, key=lambda d: d.at)[-n:]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
