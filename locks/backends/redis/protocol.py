"""What every Redis store sends and reads: client options, each script's keys, arguments and
reply, and the job record's format (one protocol, sync and asyncio transports)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.backoff import NoBackoff
from redis.retry import Retry

from jobfence.locks.backend import Busy, CommitRecord, JobRecord, LockInfo
from jobfence.locks.keys import KeySpace
from jobfence.locks.lease import OwnerMeta

SIGNAL_LIFETIME_MS = 2000
#: Leases per extend_many script: a batch of more goes as several scripts in one write (one
#: round trip), so the server serves other clients between them instead of stalling for all.
EXTEND_CHUNK = 1000


def text(value: Any) -> str:
    """A reply as text (bytes decoded as UTF-8)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_record(raw: str) -> JobRecord:
    """A job record as commit.lua stores it: '<D|F><fence>,<ms from grant to finish>,
    <length of the fingerprint>:<fingerprint><result>'."""
    first = raw.index(",", 1)
    second = raw.index(",", first + 1)
    colon = raw.index(":", second + 1)
    fence = int(raw[1:first])
    end = colon + 1 + int(raw[second + 1 : colon])
    return JobRecord(
        state=_STATES[raw[0]],
        fingerprint=raw[colon + 1 : end],
        result=raw[end:],
        fence=fence,
        finished_at=(fence // 1000 + int(raw[first + 1 : second])) / 1000,
    )


_STATES = {"D": "DONE", "F": "FAILED"}


#: The fields of a record hash written by versions before the one-string record.
LEGACY_RECORD_FIELDS = ("state", "fingerprint", "result", "fence", "finished_ms")


def stored_record(raw: Any) -> JobRecord | None:
    """A GET of the record key: the job record, or None if there is none."""
    return parse_record(text(raw)) if raw else None


def legacy_record_of(fields: Sequence[Any]) -> JobRecord | None:
    """An HMGET of LEGACY_RECORD_FIELDS (the key held a record hash): its record, if any."""
    if fields[0] is None:
        return None
    return _legacy_record(*(text(f) if f is not None else "" for f in fields))


def _legacy_record(state: str, fp: str, result: str, fence: str, finished_ms: str) -> JobRecord:
    """A record hash written by versions before the one-string record (read, never written)."""
    return JobRecord(
        state=state,
        fingerprint=fp,
        result=result,
        fence=int(fence or 0),
        finished_at=int(finished_ms or 0) / 1000,
    )


#: The lock hash's fields `parse_lock` reads: 'holder' packs host, pid, task name and
#: process start; the separate fields are read too, for locks written by versions that
#: stored them one by one.
LOCK_FIELDS = ("fence", "task_id", "holder", "acquired_ms", "heartbeat_ms", "host", "pid",
               "task_name")  # fmt: skip


def parse_lock(key: str, fields: Sequence[Any], pttl: int) -> LockInfo | None:
    """An HMGET of LOCK_FIELDS and the lock's PTTL: what `inspect` reports, None if free."""
    if fields[0] is None or pttl == -2:
        return None
    fence, task_id, holder, acq, hb, host, pid, task_name = (
        text(f) if f is not None else "" for f in fields
    )
    started = ""
    if holder:
        host, pid, task_name, started = [*holder.split("\n", 3), "", "", ""][:4]
    return LockInfo(
        key=key,
        fence=int(fence),
        ttl_left=max(0, pttl) / 1000,
        host=host,
        pid=int(pid or 0),
        task_id=task_id,
        task_name=task_name,
        acquired_at=int(acq or 0) / 1000,
        # Not written at acquire: until the first extension it is the acquisition time.
        last_heartbeat=int(hb or acq or 0) / 1000,
        process_start=started,
    )


def client_options(socket_timeout: float) -> dict[str, Any]:
    """The options of every client of a lock server, whatever finds the server."""
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
        "decode_responses": True,
        "health_check_interval": 0,
        # No client-side retries: a hung server must fail within socket_timeout, and a
        # re-sent acquire or commit is not idempotent.
        "retry": Retry(NoBackoff(), 0),
    }


# -- each script's keys, arguments and reply, shared by RedisBackend and the asyncio store
# (locks/backends/redis/async_store.py): one protocol, two transports.
def begin_call(
    k: KeySpace,
    fence_source: str,
    key: str,
    owner: str,
    ttl_ms: int,
    meta: OwnerMeta,
    record: bool,
    fingerprint: str,
    floor: int,
) -> tuple[list[str], list[Any]]:
    """begin.lua's keys and arguments."""
    holder = f"{meta.host}\n{meta.pid}\n{meta.task_name}\n{meta.process_start}"
    if record:
        return (
            [k.lock(key), fence_source, k.record(key)],
            [owner, ttl_ms, "1", meta.task_id, holder, fingerprint, floor],
        )
    return [k.lock(key), fence_source], [owner, ttl_ms, "0", meta.task_id, holder, "", floor]


def parse_begin(reply: Any) -> int | Busy | JobRecord:
    """begin.lua's reply: the new fence, Busy, or the job record."""
    if not isinstance(reply, list):
        return int(reply)
    if int(reply[0]) == 0:
        pttl = int(reply[1])
        return Busy(
            ttl_left=pttl / 1000 if pttl >= 0 else float("inf"),
            task_id=text(reply[2]) if len(reply) > 2 else "",
            fingerprint=text(reply[3]) if len(reply) > 3 else "",
        )
    if len(reply) == 2:
        return parse_record(text(reply[1]))
    return _legacy_record(*(text(x) for x in reply[1:]))


def extend_calls(
    k: KeySpace, items: Sequence[tuple[str, str, int]]
) -> list[tuple[list[str], list[Any]]]:
    """extend_many.lua's calls for `items`, EXTEND_CHUNK leases a call."""
    lock = k.lock
    calls: list[tuple[list[str], list[Any]]] = []
    for i in range(0, len(items), EXTEND_CHUNK):
        chunk = items[i : i + EXTEND_CHUNK]
        args: list[Any] = []
        for _, owner, ttl_ms in chunk:
            args += (owner, ttl_ms)
        calls.append(([lock(key) for key, _, _ in chunk], args))
    return calls


def parse_extend(replies: list[Any]) -> list[bool]:
    return [bool(int(x)) for reply in replies for x in reply]


def release_call(k: KeySpace, key: str, owner: str) -> tuple[list[str], list[Any]]:
    return [k.lock(key), k.signal(key)], [owner, SIGNAL_LIFETIME_MS]


def rate_call(
    k: KeySpace, key: str, interval_us: float, burst: int, max_wait_us: float
) -> tuple[list[str], list[Any]]:
    # Finite text for Lua: an unbounded wait is any wait.
    cap = min(max_wait_us, 1e18)
    return [k.rate(key)], [repr(interval_us), burst, repr(cap)]


def parse_rate(reply: Any) -> tuple[bool, float, float]:
    return reply[0] == 1, float(reply[1]), float(reply[2])


def commit_call(k: KeySpace, rec: CommitRecord) -> tuple[list[str], list[Any]]:
    """commit.lua's keys and arguments."""
    key, owner, fence, state, result, fingerprint, result_ttl_ms = rec
    # The record string's head and tail (commit.lua puts the finish time between them).
    head, tail = f"{state[0]}{fence}", f"{len(fingerprint)}:{fingerprint}{result}"
    return ([k.lock(key), k.record(key), k.signal(key)],
            [owner, head, tail, result_ttl_ms, SIGNAL_LIFETIME_MS])  # fmt: skip


def claim_call(k: KeySpace, key: str, task_id: str, ttl: float) -> tuple[list[str], list[Any]]:
    """claim_publish.lua's keys and arguments."""
    return [k.queued(key)], [task_id, int(ttl * 1000)]


def swap_call(
    k: KeySpace, key: str, expect: str, new: str | None, ttl_ms: int
) -> tuple[list[str], list[Any]]:
    """swap_publish.lua's keys and arguments."""
    return [k.queued(key)], [expect, new or "", ttl_ms]


def parse_held(reply: Any) -> str | None:
    """claim_publish.lua's and swap_publish.lua's reply: the value that kept the claim."""
    return text(reply) if reply else None


#: How late, past its block and the socket timeout, Redis may answer a BLPOP: it answers a
#: timed-out one on its next event-loop tick (up to 100 ms late at the default hz 10, a
#: second at hz 1). A client that reads the reply with its socket timeout alone (a
#: cluster's, a mock) blocks at most half of that timeout instead.
BLPOP_LATE = 1.0
