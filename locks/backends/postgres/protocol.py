"""Each PostgreSQL statement's parameters and answer: one protocol for the sync and async stores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobfence.locks.backend import Busy, CommitRecord, JobRecord, LockInfo
from jobfence.locks.backends.postgres.statements import CHANNEL
from jobfence.locks.lease import OwnerMeta


def begin_params(
    prefix: str, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool,
    fingerprint: str, floor: int,
) -> dict[str, Any]:  # fmt: skip
    """BEGIN's parameters."""
    return {
        "prefix": prefix, "key": key, "owner": owner, "floor": floor,
        "ttl": ttl_ms, "task_id": meta.task_id, "host": meta.host, "pid": meta.pid,
        "task_name": meta.task_name, "process_start": meta.process_start,
        "fingerprint": fingerprint if record else "", "record": record,
    }  # fmt: skip


def parse_begin(row: tuple[Any, ...]) -> int | Busy | JobRecord:
    """BEGIN's row: the new fence, the job record if DONE, or Busy."""
    granted, fence, ttl_left, task_id, fp, done, rfp, result, rfence, finished = row
    if granted:
        return int(fence)
    if done:
        return JobRecord(
            state="DONE",
            fingerprint=rfp or "",
            result=result or "",
            fence=int(rfence or 0),
            finished_at=float(finished or 0),
        )
    return Busy(ttl_left=max(0.0, float(ttl_left)), task_id=task_id, fingerprint=fp)


def commit_params(rec: CommitRecord) -> dict[str, Any]:
    """COMMIT's parameters but those of the wake (wake_params adds them)."""
    _, owner, fence, state, result, fingerprint, result_ttl_ms = rec
    return {"owner": owner, "state": state, "result": result, "fingerprint": fingerprint,
            "fence": fence, "result_ttl": result_ttl_ms}  # fmt: skip


def parse_job_record(rows: list[tuple[Any, ...]]) -> JobRecord | None:
    """JOB_RECORD's rows: the job record, if DONE or FAILED and not expired."""
    if not rows:
        return None
    state, fp, result, fence, finished = rows[0]
    return JobRecord(
        state=state,
        fingerprint=fp or "",
        result=result or "",
        fence=int(fence or 0),
        finished_at=float(finished or 0),
    )


def extend_params(prefix: str, items: Sequence[tuple[str, str, int]]) -> tuple[Any, ...]:
    """EXTEND_MANY's parameters (and the semaphore slots' twin's): keys, owners, TTLs, prefix."""
    return ([k for k, _, _ in items], [o for _, o, _ in items], [t for _, _, t in items], prefix)


def parse_extend(items: Sequence[tuple[str, str, int]], rows: list[tuple[Any, ...]]) -> list[bool]:
    """EXTEND_MANY's rows: whether each of `items` is still held."""
    # By key and owner: a batch may name one key twice (a lost lease and the new one).
    ours = {(r[0], r[1]) for r in rows}
    return [(k, o) in ours for k, o, _ in items]


def wake_params(prefix: str, key: str, params: dict[str, Any]) -> dict[str, Any]:
    """A release's (or commit's) parameters, with the NOTIFY that wakes the key's waiters."""
    return {**params, "prefix": prefix, "key": key, "channel": CHANNEL,
            "payload": f"{prefix}\n{key}"}  # fmt: skip


def like_prefix(match: str) -> str:
    """A LIKE pattern for the literal head of glob `match` (the glob itself is applied after)."""
    head = ""
    for ch in match:
        if ch in "*?[":
            break
        head += ch
    return head.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def lock_info(key: str, row: tuple[Any, ...]) -> LockInfo:
    """INSPECT's row (SCAN's after the key): the lock `key`'s holder."""
    fence, ttl_left, host, pid, task_id, task_name, acquired, heartbeat, started = row
    return LockInfo(
        key=key,
        fence=int(fence),
        ttl_left=max(0.0, float(ttl_left)),
        host=host,
        pid=int(pid),
        task_id=task_id,
        task_name=task_name,
        acquired_at=float(acquired or 0),
        last_heartbeat=float(heartbeat or 0),
        process_start=started,
    )
