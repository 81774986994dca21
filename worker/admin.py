"""Lock administration for the CLI: list, inspect, force-release, and find orphaned locks."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from jobfence.config import Settings
from jobfence.config.settings import refuse_insecure
from jobfence.locks import (
    LockBackend,
    LockError,
    LockInfo,
    RedisBackend,
    RedisFenceGuard,
    open_backend,
    procinfo,
)
from jobfence.locks.backend import default_meta
from jobfence.locks.procinfo import pid_alive, proc_state

LATE_FRACTION = 0.5  # a heartbeat older than half the lock's TTL missed at least one beat
ADVANCE_TTL = 5.0  # seconds the grant that advances a key's fence is held (released at once)


def open_admin_backend(settings: Settings) -> LockBackend:
    refuse_insecure(settings)  # before any connection: no password over a refused channel
    return open_backend(
        settings.lock_url,
        prefix=settings.key_prefix,
        socket_timeout=settings.socket_timeout,
        fence_retention=settings.fence_retention,
    )


def server_time(backend: LockBackend) -> float:
    """Now on the lock server's clock (heartbeats are stamped with it)."""
    if isinstance(backend, RedisBackend):
        seconds, micros = backend.client.time()
        return float(seconds) + float(micros) / 1e6
    return backend.server_time()


# --------------------------------------------------------------------------- orphans


@dataclass(frozen=True)
class Orphan:
    """A held lock worth reporting: its owner provably dead (`dead`), or a suspect.

    Only a dead one may be released. A suspect (a late heartbeat, a stopped process, a
    holder on another host or in another pid namespace) is reported, never released:
    a late heartbeat is what a frozen but live holder shows too.
    """

    info: LockInfo
    reason: str
    dead: bool = True
    heartbeat_age: float | None = None
    ttl: float | None = None  # the lock's own TTL: heartbeat age + TTL left
    #: dead, stopped (a SIGSTOPped holder), suspect (alive, heartbeat late) or unknowable
    #: (another host or pid namespace, with a late heartbeat)
    verdict: str = "dead"


def _heartbeat(info: LockInfo, now: float) -> tuple[float | None, float | None, str]:
    """Heartbeat age, the lock's own TTL, and a phrase for them."""
    if info.last_heartbeat <= 0:
        return None, None, "no heartbeat recorded"
    age = max(0.0, now - info.last_heartbeat)
    ttl = age + info.ttl_left  # each extension sets the lock's TTL afresh
    return age, ttl, f"heartbeat {age:.1f}s ago (TTL {ttl:.1f}s)"


def orphan_reason(
    info: LockInfo, *, now: float, hostname: str, here: str | None = None
) -> Orphan | None:
    """Judge one lock: an Orphan (dead or suspect), or None if nothing is wrong with it.

    Dead needs proof, on this host and in this pid namespace: the pid is gone, or it now
    belongs to another process (a start time other than the one recorded at grant), or
    the host rebooted since the grant. A stopped process is alive.
    """
    here = procinfo.namespace() if here is None else here
    age, ttl, beat = _heartbeat(info, now)
    late = age is not None and ttl is not None and age > LATE_FRACTION * ttl
    pid = info.pid

    def found(reason: str, dead: bool, verdict: str = "dead") -> Orphan:
        return Orphan(
            info, f"{reason}; {beat}", dead=dead, heartbeat_age=age, ttl=ttl, verdict=verdict
        )

    unknowable, rebooted = _out_of_reach(info, hostname=hostname, here=here)
    if rebooted:
        return found(unknowable, True)
    if unknowable:
        return found(unknowable, False, "unknowable") if late else None
    state = proc_state(pid)
    if not pid_alive(pid):
        return found(f"pid {pid} is not running on {hostname}", True)
    if info.process_start and procinfo.process_start(pid) not in ("", info.process_start):
        return found(f"pid {pid} now belongs to a process started after the grant", True)
    if state in ("T", "t"):
        return found(f"pid {pid} is stopped (alive: it may resume)", False, "stopped")
    if late:
        return found(f"pid {pid} is alive but its heartbeat is late", False, "suspect")
    return None


def _out_of_reach(info: LockInfo, *, hostname: str, here: str) -> tuple[str, bool]:
    """Why this holder's liveness cannot be checked from here ("" if it can), and whether that
    is because the host rebooted since the grant (proof the holder is dead)."""
    pid = info.pid
    recorded = info.process_start.rsplit("/", 1)[0] if info.process_start else ""
    if info.host != hostname:
        return f"held on host {info.host or '?'}: its pid cannot be checked here", False
    if pid <= 0:
        return "no pid recorded", False
    if recorded and here and recorded != here:
        if recorded.split("/", 1)[0] != here.split("/", 1)[0]:
            return f"this host rebooted since pid {pid} took it", True
        return f"pid {pid} is in another pid namespace: cannot check it here", False
    return "", False


@dataclass(frozen=True)
class Liveness:
    """What can be said from here of a lock holder: a verdict and the reason for it.

    `verdict` is alive, stopped, suspect, dead (proven) or unknowable (another host or pid
    namespace, no pid recorded). Only a dead holder's lock may be released by an operator.
    """

    verdict: str
    reason: str


def liveness(info: LockInfo, *, now: float, hostname: str, here: str | None = None) -> Liveness:
    """The orphan finder's judgement of one holder, with a verdict for a healthy one too."""
    orphan = orphan_reason(info, now=now, hostname=hostname, here=here)
    if orphan is not None:
        return Liveness(orphan.verdict, orphan.reason)
    _, _, beat = _heartbeat(info, now)
    here = procinfo.namespace() if here is None else here
    recorded = info.process_start.rsplit("/", 1)[0] if info.process_start else ""
    if info.host != hostname:
        return Liveness("unknowable", f"held on host {info.host or '?'}; {beat}")
    if info.pid <= 0:
        return Liveness("unknowable", f"no pid recorded; {beat}")
    if recorded and here and recorded != here:
        return Liveness("unknowable", f"pid {info.pid} is in another pid namespace; {beat}")
    return Liveness("alive", f"pid {info.pid} is running on {hostname}; {beat}")


def find_orphans(
    backend: LockBackend, *, match: str = "*", hostname: str | None = None
) -> list[Orphan]:
    """Dead and suspect holders of the locks matching `match`."""
    host = hostname or socket.gethostname()
    now = server_time(backend)
    found = []
    for info in backend.scan(match):
        orphan = orphan_reason(info, now=now, hostname=host)
        if orphan is not None:
            found.append(orphan)
    return found


# --------------------------------------------------------------------------- releasing


def release_grant(backend: LockBackend, key: str, fence: int) -> bool:
    """Remove `key` only if it is still held under `fence` (the grant judged): owner-checked.

    Fences are unique per grant, so the fence stands for the owner the admin never sees;
    every backend checks it in the removing operation itself.
    """
    return backend.release_grant(key, fence)


@dataclass(frozen=True)
class ForcedRelease:
    """What `locks release --force` did."""

    held: LockInfo | None  # the holder removed; None if the key was not held
    floor: int | None  # a fence above every earlier grant's, at or below every later one
    advanced: dict[str, int]  # guard resource -> the floor now in force there


def force_release(
    backend: LockBackend, key: str, *, resources: Sequence[str] = (), guard_prefix: str
) -> ForcedRelease:
    """Release `key` whatever its owner, advance its fence, and raise guard floors.

    The fence is advanced by taking a grant and releasing it at once, so the removed
    holder's token is below `floor` and every later grant is above it. Raising a Redis
    guard resource's floor to `floor` makes the removed holder's writes there fail now,
    not only once a newer holder has written.
    """
    if resources and not isinstance(backend, RedisBackend):
        raise LockError("--fence-resource needs the Redis lock backend (the guard lives there)")
    held = backend.inspect(key)
    if held is None and not resources:
        return ForcedRelease(None, None, {})
    # Not held: a holder whose lease expired may still write, so the floors still rise.
    if held is not None and not release_grant(backend, key, held.fence):
        raise LockError("the lock changed hands while it was being released; run again", key=key)
    floor = advance_fence(backend, key)
    advanced: dict[str, int] = {}
    if resources:
        assert isinstance(backend, RedisBackend)
        guard = RedisFenceGuard(backend.client, prefix=guard_prefix)
        advanced = {r: guard.advance(r, floor) for r in resources}
    return ForcedRelease(held, floor, advanced)


def advance_fence(backend: LockBackend, key: str) -> int:
    """A fence above every grant of `key` so far and at or below every later one."""
    meta = default_meta(task_name="jobfence locks release --force")
    for _ in range(20):
        lease = backend.try_acquire(key, ADVANCE_TTL, meta=meta)
        if lease is not None:
            backend.release(lease)
            return lease.fence
        taken = backend.inspect(key)  # someone was faster: their grant is newer still
        if taken is not None:
            return taken.fence
    raise LockError("could not take a grant to advance the fence; run again", key=key)


# --------------------------------------------------------------------------- rendering


def printable(text: object) -> str:
    """`text` fit for a terminal: control characters (ESC, BEL, CR, C1 CSI, ...) shown as
    escapes such as \\x1b, so stored data (a key, a task id any publisher chooses, a host
    name) cannot move the cursor, retitle the window or hide text."""
    value = str(text)
    if value.isprintable():
        return value
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in value
    )


def lock_name(info: LockInfo) -> str:
    """A lock as `locks list` names it: its key as its owner gave it, made printable."""
    return printable(info.key)


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
            lock_name(info),
            str(info.fence),
            f"{info.ttl_left:.1f}s",
            f"{info.host or '?'}:{info.pid or '?'}",
            task,
            _age(info_dict(info, now)["heartbeat_age"]) + " ago",
        ]
        if extra is not None:
            row.append(extra.get(info.key, ""))
        rows.append([printable(cell) for cell in row])
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
    return "\n".join(printable(line) for line in lines)


def _when(epoch: float) -> str:
    if not epoch:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1000):03d}Z"
