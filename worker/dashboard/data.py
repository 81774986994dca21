"""What the dashboard reads from a lock backend: locks by page, holders' liveness, slots,
rate limits, leaders, job records; and an app's beat slots. Redis backends page with SCAN
cursors; others list all."""

from __future__ import annotations

import datetime
import fnmatch
import hashlib
import re
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jobfence.locks import LockBackend, LockInfo, RedisBackend
from jobfence.locks.backends.redis import parse_record
from jobfence.locks.backends.redis.cluster import RedisClusterBackend
from jobfence.locks.backends.redis.semaphores import semaphore_keys
from jobfence.locks.leader import LEADER_KEY_PREFIX
from jobfence.worker.admin import liveness, lock_name, printable, server_time

BEAT_LEADER_KEY = "beat-leader"  # worker/beat.py's default (not imported: it needs Celery)
PAGE_SIZE = 50
REASON_CHARS = 60  # a reason's length on a list; the lock page shows all of it
MAX_FILTER = 200  # characters of a filter
_HEX = re.compile(r"[0-9a-f]{16,}")
_KEY_ID = re.compile(r"[0-9a-f]{24}")
_CURSOR = re.compile(r"(?:r|o)\d{1,20}")


class BadInput(ValueError):
    """A filter, cursor or key id the dashboard refuses; the message names the field and fix."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def key_id(key: str) -> str:
    """A key's id in URLs and forms: a hash, so a key made of arguments never shows."""
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def key_label(key: str, task_name: str) -> str:
    """How a key is shown: its task name and a hash (a job key is exactly that already)."""
    head, _, tail = key.rpartition(":")
    if task_name and head == task_name and _HEX.fullmatch(tail):
        return printable(key)
    return f"{printable(task_name or 'lock')} #{key_id(key)[:12]}"


def row_label(info: LockInfo, *, names: bool = True) -> str:
    """How a held lock is shown: a plain lock (no task: `Locker.lock("report:monthly")`) by the
    name its owner gave it, as `jobfence locks list` shows it (`names` False: as its hash); a
    task's lock as `key_label` shows it (its key may be made of arguments)."""
    if names and not info.task_name:
        return lock_name(info)
    return key_label(info.key, info.task_name)


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """`text` cut to one line of at most `limit` characters (at a word where one is near),
    ending in "…" when cut."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ;,:") + "…"


def check_key_id(value: str) -> str:
    if not _KEY_ID.fullmatch(value or ""):
        raise BadInput("lock id must be the 24 hex digits the locks page links to; open it there")
    return value


def check_glob(value: str, field_name: str) -> str:
    """A filter glob: printable, short, balanced brackets, no braces (they delimit keys)."""
    value = value.strip()
    if not value:
        return "*"
    if len(value) > MAX_FILTER or not value.isprintable():
        raise BadInput(f"{field_name} must be at most {MAX_FILTER} printable characters")
    if "{" in value or "}" in value:
        raise BadInput(f"{field_name} may not contain braces; use * and ? to match")
    if value.count("[") != value.count("]"):
        raise BadInput(f"{field_name} has an unclosed [ ]; write [abc] or drop the bracket")
    try:
        re.compile(fnmatch.translate(value))
    except re.error as exc:
        raise BadInput(f"{field_name} is not a valid glob ({exc}); use * ? and [abc]") from None
    return value


def check_cursor(value: str) -> str:
    if value and not _CURSOR.fullmatch(value):
        raise BadInput("cursor must be the value the Next link carries; start again from page 1")
    return value


@dataclass(frozen=True)
class LockRow:
    """One held lock as the pages show it. `info` (which holds the key) is never rendered;
    `label` is a plain lock's name unless names are hidden, `hidden` never a name."""

    info: LockInfo = field(repr=False)
    id: str
    label: str
    verdict: str
    reason: str
    heartbeat_age: float | None
    hidden: str = ""  # the label without a plain lock's name (task name and hash): for logs

    @property
    def holder(self) -> str:
        return printable(f"{self.info.host or '?'}:{self.info.pid or '?'}")

    @property
    def short_reason(self) -> str:
        """The reason on one line, for a list; the lock page shows all of it."""
        return one_line(self.reason)


@dataclass(frozen=True)
class LockPage:
    rows: list[LockRow]
    next_cursor: str  # "" on the last page
    now: float


class LockView:
    """Reads one backend for the dashboard; `hostname` is where liveness is judged from."""

    def __init__(
        self, backend: LockBackend, *, hostname: str | None = None, hide_names: bool = False
    ) -> None:
        self.backend = backend
        self.hostname = hostname or socket.gethostname()
        self.hide_names = hide_names  # plain locks by their hash, not their owner's name

    # ----------------------------------------------------------------------- locks
    @property
    def pages_with_cursor(self) -> bool:
        """Redis (not cluster) pages with SCAN cursors; other backends list every match."""
        return isinstance(self.backend, RedisBackend) and not isinstance(
            self.backend, RedisClusterBackend
        )

    def row(self, info: LockInfo, now: float) -> LockRow:
        live = liveness(info, now=now, hostname=self.hostname)
        age = max(0.0, now - info.last_heartbeat) if info.last_heartbeat > 0 else None
        key = info.key
        return LockRow(info, key_id(key), row_label(info, names=not self.hide_names),
                       live.verdict, printable(live.reason), age,
                       key_label(key, info.task_name))  # fmt: skip

    def locks(
        self, *, match: str = "*", task: str = "*", cursor: str = "", size: int = PAGE_SIZE
    ) -> LockPage:
        """One page of held locks whose key matches `match` and task name matches `task`."""
        now = server_time(self.backend)

        def wanted(info: LockInfo) -> bool:
            return task == "*" or fnmatch.fnmatchcase(info.task_name, task)

        if self.pages_with_cursor and not cursor.startswith("o"):
            infos, nxt = self._redis_page(match, int(cursor[1:] or 0), size, wanted)
        else:
            start = int(cursor[1:] or 0)
            found = sorted((i for i in self.backend.scan(match) if wanted(i)),
                           key=lambda i: i.key)  # fmt: skip
            infos = found[start : start + size]
            nxt = f"o{start + size}" if start + size < len(found) else ""
        return LockPage([self.row(i, now) for i in infos], nxt, now)

    def _redis_page(
        self, match: str, cursor: int, size: int, wanted: Callable[[LockInfo], bool]
    ) -> tuple[list[LockInfo], str]:
        assert isinstance(self.backend, RedisBackend)
        backend, pattern = self.backend, self.backend.keys.lock_pattern(match)
        infos: list[LockInfo] = []
        for _ in range(100):  # SCAN may answer few or none per call: a bounded few calls
            cursor, names = backend.client.scan(cursor, match=pattern, count=max(size, 100))
            for name in names:
                info = backend.inspect(backend.keys.key_of_lock(_text(name)))
                if info is not None and wanted(info):
                    infos.append(info)
            if cursor == 0 or len(infos) >= size:
                break
        return sorted(infos, key=lambda i: i.key), (f"r{cursor}" if cursor else "")

    def find(self, wanted_id: str, *, match: str = "*") -> LockInfo | None:
        """The held lock whose key id is `wanted_id` (a scan: ids are hashes)."""
        check_key_id(wanted_id)
        return next((i for i in self.backend.scan(match) if key_id(i.key) == wanted_id), None)

    def decisions(self, key: str, limit: int = 50) -> list[dict[str, str]] | None:
        """The key's recent decisions, oldest first, in the words of `locks why`, if the
        backend keeps a decision log (tasks/decisions.py); None if it keeps none."""
        from jobfence.locks.decisions import DecisionBounds
        from jobfence.tasks.decisions import describe

        log = self.backend.decision_log(DecisionBounds())
        if log is None:
            return None
        rows = []
        for d in log.for_key(key, limit):
            when = datetime.datetime.fromtimestamp(d.at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
            rows.append(_safe_fields({"when": when, "decision": describe(d), "task": d.task_name,
                                      "task id": d.task_id, "fence": d.fence or ""}))  # fmt: skip
        return rows

    def highest_fence(self, key: str) -> int | None:
        """The highest fence the server granted on `key` (Redis keeps it), None if unknown."""
        if not isinstance(self.backend, RedisBackend):
            return None
        raw = self.backend.client.get(self.backend.keys.fence(key))
        return int(raw) if raw is not None else None

    # ----------------------------------------------------------------------- slots
    def semaphores(self) -> list[dict[str, Any]] | None:
        """Each semaphore with held slots or waiters: holders and waiters (None: not listable)."""
        if not self.pages_with_cursor or not self.backend.capabilities.semaphore:
            return None
        assert isinstance(self.backend, RedisBackend)
        client, prefix = self.backend.client, self.backend.keys.prefix
        now_ms = server_time(self.backend) * 1000
        head, tail = f"{prefix}:sem:{{", "}:state"
        out = []
        for name in client.scan_iter(match=f"{head}*{tail}", count=500):
            key = _text(name)[len(head) : -len(tail)]
            _, _, qexp, _, _ = semaphore_keys(prefix, key)
            holders = self.backend.semaphore_holders(key)
            waiting = int(client.zcount(qexp, f"({now_ms}", "+inf"))
            task = holders[0].task_name if holders else ""
            out.append({"id": key_id(key), "label": key_label(key, task), "held": len(holders),
                        "waiting": waiting, "holders": holders})  # fmt: skip
        return sorted(out, key=lambda s: str(s["label"]))

    def rate_limits(self) -> list[dict[str, Any]] | None:
        """Each rate limit's GCRA state: how far ahead its next turn is (None: not listable)."""
        if not self.pages_with_cursor or not self.backend.capabilities.rate_limit:
            return None
        assert isinstance(self.backend, RedisBackend)
        client, prefix = self.backend.client, self.backend.keys.prefix
        now = server_time(self.backend)
        head = f"{prefix}:rate:{{"
        out = []
        for name in client.scan_iter(match=f"{head}*}}", count=500):
            key = _text(name)[len(head) : -1]
            raw = client.get(name)
            try:
                turn = float(raw) / 1e6 if raw is not None else 0.0
            except ValueError:
                turn = 0.0
            out.append({"id": key_id(key), "label": key_label(key, ""),
                        "ahead": max(0.0, turn - now) if turn else 0.0})  # fmt: skip
        return sorted(out, key=lambda s: str(s["label"]))

    # ----------------------------------------------------------------------- leaders
    def leaders(self) -> list[LockRow]:
        """Held election keys (`leader:<name>`) and the beat's, with the term's fence."""
        now = server_time(self.backend)
        found = [i for i in self.backend.scan(f"{LEADER_KEY_PREFIX}*")]
        beat = self.backend.inspect(BEAT_LEADER_KEY)
        found += [beat] if beat is not None else []
        return [self._leader_row(i, now) for i in sorted(found, key=lambda i: i.key)]

    def _leader_row(self, info: LockInfo, now: float) -> LockRow:
        row = self.row(info, now)  # an election's name is no argument: shown as it is
        return LockRow(info, row.id, printable(info.key), row.verdict, row.reason,
                       row.heartbeat_age, printable(info.key))  # fmt: skip

    # ----------------------------------------------------------------------- records
    def records(self, *, task: str = "*", limit: int = 200) -> list[dict[str, Any]] | None:
        """Job records (DONE, FAILED) of tasks matching `task` (None: not listable here)."""
        if not self.pages_with_cursor:
            return None
        assert isinstance(self.backend, RedisBackend)
        client, prefix = self.backend.client, self.backend.keys.prefix
        head = f"{prefix}:job:{{"
        out: list[dict[str, Any]] = []
        for name in _take(client.scan_iter(match=f"{head}{task}:*}}", count=500), limit):
            key = _text(name)[len(head) : -1]
            raw = client.get(name) if client.type(name) in (b"string", "string") else None
            if raw is None:
                continue
            record = parse_record(_text(raw))
            task_name = key.rpartition(":")[0]
            out.append({"id": key_id(key), "label": key_label(key, task_name),
                        "state": record.state, "fence": record.fence,
                        "finished_at": record.finished_at,
                        "result_size": len(record.result)})  # fmt: skip
        return sorted(out, key=lambda r: -float(r["finished_at"]))


def _take(items: Iterator[Any], limit: int) -> Iterator[Any]:
    for n, item in enumerate(items):
        if n >= limit:
            return
        yield item


_HIDDEN = re.compile(r"owner|token|secret|arg|kwarg|password|payload", re.IGNORECASE)


def _safe_fields(entry: Any) -> dict[str, str]:
    """A decision-log entry's fields as text, without owner tokens, arguments or secrets."""
    items: Iterable[tuple[Any, Any]]
    if isinstance(entry, dict):
        items = entry.items()
    elif hasattr(entry, "__dataclass_fields__"):
        items = ((f, getattr(entry, f)) for f in entry.__dataclass_fields__)
    elif hasattr(entry, "_asdict"):
        items = entry._asdict().items()
    else:
        items = (("entry", entry),)
    return {
        printable(k): printable(v) if k != "key" else key_label(str(v), "")
        for k, v in items
        if not _HIDDEN.search(str(k))
    }


def beat_rows(app: Any) -> list[dict[str, str]] | None:
    """Each beat entry's latest due slot (its idempotency key) and next one; None if no app."""
    if app is None:
        return None
    from celery.beat import ScheduleEntry

    from jobfence.worker.beat_slots import format_slot, slot_time

    rows = []
    for name, spec in sorted((app.conf.beat_schedule or {}).items()):
        entry = ScheduleEntry(name=name, task=spec["task"], schedule=spec["schedule"], app=app)
        now = entry.default_now()
        slot = slot_time(entry, now)
        nxt = now + entry.schedule.remaining_estimate(slot)
        rows.append({"name": printable(name), "task": printable(spec["task"]),
                     "slot": f"{printable(name)}@{format_slot(slot)}",
                     "next": format_slot(nxt)})  # fmt: skip
    return rows
