"""The durable publish on commit: a message written in the caller's transaction, sent after it.

`task.apply_async_on_commit(args, kwargs, session=...)` (SQLAlchemy) or
`task.delay_on_commit(...)` inside Django's `atomic()` writes one row to `jobfence_outbox`
in the caller's own transaction: the task id chosen then, the task's name, its arguments
and publish options. A rollback leaves nothing. Once the transaction commits, the message
is published at once and the row marked sent. A process that dies between the commit and
the publish, or a broker that is down then, leaves the row unsent: the fleet's relay
(`OutboxRelay`, one at a time, elected on the lock server) publishes it after
`JOBFENCE_OUTBOX_GRACE` seconds. A row published twice (the process died after its publish
but before the mark) goes out under the same task id, and the gate absorbs the copy: its
DONE record answers it, or it defers to the running delivery of its own id.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, delete, func, select, update

from jobfence.locks.sql import ensure_tables
from jobfence.tasks.celery_publish import OUTBOX_OPTION
from jobfence.tasks.effects import outbox
from jobfence.tasks.errors import ArgumentsNotSerializable

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from jobfence.tasks.celery_task import SingletonTask

log = logging.getLogger(__name__)

#: Publish options a message keeps in the outbox (each JSON; `eta` and `expires` as times).
KEPT_OPTIONS = frozenset({
    "countdown", "eta", "expires", "queue", "routing_key", "exchange", "priority",
    "headers", "idempotency_key", "time_limit", "soft_time_limit", "ignore_result",
    "serializer", "compression", "retry", "retry_policy",
})  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One message of the outbox, as written and as the relay reads it back."""

    task_id: str
    task_name: str
    payload: str
    created_at: float

    def row(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "task_name": self.task_name, "payload": self.payload,
                "created_at": self.created_at, "sent_at": None, "attempts": 0}  # fmt: skip


def entry_for(
    task: SingletonTask, args: Any, kwargs: Any, options: Mapping[str, Any], task_id: str
) -> Entry:
    """The outbox row of this publish, refused before anything is written: arguments that
    do not bind or are not JSON, or an option the outbox cannot keep (named, with the fix)."""
    args, kwargs = list(args or ()), dict(kwargs or {})
    task.identity(args, kwargs, options.get("idempotency_key"))  # binds, refuses non-JSON
    return entry_of(task.name, args, kwargs, options, task_id)


def entry_of(
    name: str, args: list[Any], kwargs: dict[str, Any], options: Mapping[str, Any], task_id: str
) -> Entry:
    """The outbox row of a publish of the task `name` (its arguments bound already): refused
    before anything is written if an option cannot be kept or anything is not JSON."""
    now = time.time()
    kept: dict[str, Any] = {}
    for option, value in options.items():
        if option not in KEPT_OPTIONS:
            raise ArgumentsNotSerializable(
                f"{name}: the publish option {option!r} cannot be kept in the outbox; "
                f"publish on commit takes {', '.join(sorted(KEPT_OPTIONS))}"
            )
        if option in ("eta", "expires") and isinstance(value, datetime):
            if value.tzinfo is None:
                raise ArgumentsNotSerializable(
                    f"{name}: {option}= must be a timezone-aware datetime in the outbox "
                    "(a naive one is ambiguous once the relay sends it later)"
                )
            kept[f"{option}_at"] = value.timestamp()
        elif option == "expires" and isinstance(value, int | float):
            kept["expires_at"] = now + float(value)
        else:
            kept[option] = value
    try:
        payload = json.dumps({"args": args, "kwargs": kwargs, "options": kept},
                             sort_keys=True, allow_nan=False)  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise ArgumentsNotSerializable(
            f"{name}: an argument or publish option is not JSON; the outbox keeps them as JSON"
        ) from exc
    return Entry(task_id, name, payload, now)


def publish_entry(app: Any, entry: Entry) -> None:
    """Send `entry`'s message under its own task id (countdown and expiry measured from when
    it was written)."""
    data = json.loads(entry.payload)
    options: dict[str, Any] = dict(data["options"])
    now = time.time()
    countdown = options.pop("countdown", None)
    due = options.pop("eta_at", None)
    if due is None and countdown:
        due = entry.created_at + float(countdown)
    if due is not None and due > now:
        options["countdown"] = due - now
    expires_at = options.pop("expires_at", None)
    if expires_at is not None:
        options["expires"] = max(expires_at - now, 0.001)
    task = app.tasks.get(entry.task_name)
    if task is None:  # not registered here: sent by name, as Celery's send_task does
        app.send_task(entry.task_name, data["args"], data["kwargs"],
                      task_id=entry.task_id, **options)  # fmt: skip
    elif hasattr(task, "jobfence_options"):
        # A duplicate goes out too, and meets the holder at the gate: the caller's task id
        # then ends in a typed stop naming the holder, or its DONE record, never PENDING.
        task.apply_async(data["args"], data["kwargs"], task_id=entry.task_id,
                         **{OUTBOX_OPTION: entry.created_at}, **options)  # fmt: skip
    else:  # a plain Celery task (a Django task's carrier, CeleryBackend)
        task.apply_async(data["args"], data["kwargs"], task_id=entry.task_id, **options)


class SqlOutbox:
    """The outbox table on one SQLAlchemy engine: rows written in a caller's transaction,
    marked sent, read back by the relay, pruned."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.table = outbox

    def write(self, conn: Connection, entry: Entry) -> None:
        ensure_tables(conn, (self.table,))
        conn.execute(self.table.insert().values(**entry.row()))

    def mark_sent(self, task_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(self.table)
                .where(self.table.c.task_id == task_id, self.table.c.sent_at.is_(None))
                .values(sent_at=time.time())
            )

    def note_failure(self, task_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(self.table)
                .where(self.table.c.task_id == task_id)
                .values(attempts=self.table.c.attempts + 1)
            )

    def due(self, older_than: float, limit: int) -> list[Entry]:
        """Unsent rows written before `older_than` (epoch seconds), oldest first."""
        t = self.table
        query = (
            select(t.c.task_id, t.c.task_name, t.c.payload, t.c.created_at)
            .where(t.c.sent_at.is_(None), t.c.created_at <= older_than)
            .order_by(t.c.created_at)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [Entry(*row) for row in conn.execute(query)]

    def unsent(self) -> int:
        t = self.table
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).where(t.c.sent_at.is_(None))).scalar_one())

    def prune(self, sent_before: float) -> int:
        """Delete rows sent before `sent_before`; how many went."""
        t = self.table
        with self.engine.begin() as conn:
            done = conn.execute(delete(t).where(t.c.sent_at.is_not(None),
                                                t.c.sent_at < sent_before))  # fmt: skip
            return int(done.rowcount or 0)


def publish_after_commit(
    app: Any, entry: Entry, mark_sent: Callable[[str], None]
) -> None:
    """The commit landed: publish now and mark the row sent. A failure is logged (no
    arguments, no URL) and left to the relay, which sends the row after its grace."""
    try:
        publish_entry(app, entry)
    except Exception as exc:
        log.warning("%s: publish of task %s after commit failed (%s); the outbox relay sends "
                    "it", entry.task_name, entry.task_id, type(exc).__name__)  # fmt: skip
        return
    try:
        mark_sent(entry.task_id)
    except Exception as exc:  # sent; the relay may send it again, and the gate absorbs it
        log.warning("%s: task %s was sent but not marked sent (%s)", entry.task_name,
                    entry.task_id, type(exc).__name__)  # fmt: skip


def on_commit_sqlalchemy(task: SingletonTask, entry: Entry, session: Session) -> None:
    """Write `entry` in `session`'s transaction; publish once its root transaction commits."""
    from jobfence.tasks.effects import _after_commit

    conn = session.connection()
    store = SqlOutbox(conn.engine)
    store.write(conn, entry)
    _after_commit(session, lambda: publish_after_commit(task.app, entry, store.mark_sent))


def on_commit_django(app: Any, entry: Entry, using: str | None) -> None:
    """Write `entry` on Django's connection `using`, inside its transaction if one is open;
    publish it on the Celery app `app` on its commit (`transaction.on_commit`)."""
    from django.db import DEFAULT_DB_ALIAS, connections, transaction

    alias = using or DEFAULT_DB_ALIAS
    with connections[alias].cursor() as cur:
        cur.execute(
            "INSERT INTO jobfence_outbox (task_id, task_name, payload, created_at, sent_at, "
            "attempts) VALUES (%s, %s, %s, %s, NULL, 0)",
            [entry.task_id, entry.task_name, entry.payload, entry.created_at],
        )

    def mark_sent(task_id: str) -> None:
        with connections[alias].cursor() as cur:
            cur.execute("UPDATE jobfence_outbox SET sent_at = %s WHERE task_id = %s "
                        "AND sent_at IS NULL", [time.time(), task_id])  # fmt: skip

    transaction.on_commit(lambda: publish_after_commit(app, entry, mark_sent), using=alias)
