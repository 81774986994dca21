"""Lock administration for the CLI: list, inspect, force-release, and find orphaned locks."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from jobfence.config import Settings
from jobfence.locks import LockBackend, LockInfo, RedisBackend, open_backend
from jobfence.worker.procs import pid_alive

DEFAULT_STALE_FACTOR = 2.0


def open_admin_backend(settings: Settings) -> LockBackend:
    return open_backend(
        settings.lock_url,
        prefix=settings.key_prefix,
        socket_timeout=settings.socket_timeout,
        fence_retention=settings.fence_retention,
    )


def server_time(backend: LockBackend) -> float:
    """Now on the lock server's clock (heartbeats are stamped with it), else locally."""
    if isinstance(backend, RedisBackend):
        seconds, micros = backend.client.time()
        return float(seconds) + float(micros) / 1e6
    return time.time()


@dataclass(frozen=True)
class Orphan:
    """A held lock whose owner is provably dead, and why we think so."""

    info: LockInfo
    reason: str


def orphan_reason(info: LockInfo, *, now: float, hostname: str, stale_after: float) -> str | None:
    """Why `info`'s owner is dead: its pid is gone from this very host, or its heartbeat
    stopped more than `stale_after` seconds ago. None if neither is shown."""
    if info.host == hostname and info.pid > 0 and not pid_alive(info.pid):
        return f"pid {info.pid} is not running on {hostname}"
    if info.last_heartbeat > 0:
        age = now - info.last_heartbeat
        if age > stale_after:
            return f"no heartbeat for {age:.1f}s (more than {stale_after:g}s)"
    return None


def find_orphans(
    backend: LockBackend, *, stale_after: float, match: str = "*", hostname: str | None = None
) -> list[Orphan]:
    host = hostname or socket.gethostname()
    now = server_time(backend)
    found = []
    for info in backend.scan(match):
        reason = orphan_reason(info, now=now, hostname=host, stale_after=stale_after)
        if reason is not None:
            found.append(Orphan(info, reason))
    return found


# --------------------------------------------------------------------------- rendering


def info_dict(info: LockInfo, now: float) -> dict[str, Any]:
    """A LockInfo as JSON-ready data (it never holds the owner token)."""
    data = asdict(info)
    data["heartbeat_age"] = round(now - info.last_heartbeat, 3) if info.last_heartbeat else None
    return data


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def table(infos: Iterable[LockInfo], now: float, extra: dict[str, str] | None = None) -> str:
    """A plain-text table of locks; `extra` adds a REASON column keyed by lock key."""
    header = ["KEY", "FENCE", "TTL LEFT", "HOLDER", "TASK", "HEARTBEAT"]
    if extra is not None:
        header.append("REASON")
    rows = [header]
    for info in infos:
        task = info.task_name or "-"
        if info.task_id:
            task += f" [{info.task_id}]"
        row = [
            info.key,
            str(info.fence),
            f"{info.ttl_left:.1f}s",
            f"{info.host or '?'}:{info.pid or '?'}",
            task,
            _age(info_dict(info, now)["heartbeat_age"]) + " ago",
        ]
        if extra is not None:
            row.append(extra.get(info.key, ""))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def describe(info: LockInfo, now: float) -> str:
    """`locks inspect` output: one field a line."""
    d = info_dict(info, now)
    lines = [
        f"key:            {info.key}",
        f"fence:          {info.fence}",
        f"ttl left:       {info.ttl_left:.3f}s",
        f"holder:         host {info.host or '?'}, pid {info.pid or '?'}",
        f"task:           {info.task_name or '-'} {info.task_id or ''}".rstrip(),
        f"acquired:       {_when(info.acquired_at)}",
        f"last heartbeat: {_when(info.last_heartbeat)} ({_age(d['heartbeat_age'])} ago)",
    ]
    return "\n".join(lines)


def _when(epoch: float) -> str:
    if not epoch:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1000):03d}Z"
