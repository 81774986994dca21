"""Beat slots: the scheduled time of each run of an entry, its idempotency key and task id, and
the fleet's mark of the last slot dispatched, kept on the lock server.

An interval entry runs on the epoch-aligned grid (every 10 s means at :00, :10, ...), so beats
started at different times agree; a crontab entry's slot is its latest firing time at or before
now; other schedules (solar) fall back to their due time, to the second.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from datetime import UTC, date, datetime, time, timedelta, tzinfo

from celery.beat import ScheduleEntry
from celery.schedules import BaseSchedule, crontab, schedule

from jobfence.locks.flows import Flow
from jobfence.locks.ops import SwapPublish

CRON_LOOKBACK_DAYS = 366 * 4 + 1  # a crontab fires at least once in four years (Feb 29)
MAX_CATCHUP_SLOTS = 100  # per entry and hand-over: a short interval never floods the broker
#: How long the lock server keeps an entry's last dispatched slot after the dispatch: longer
#: than any gap between two slots of a yearly crontab, so "no mark" means "never dispatched".
MARK_TTL = 400 * 86400.0
MARK_ATTEMPTS = 3  # compare-and-set tries of a mark that another beat moved meanwhile
NO_MARK = "-"  # never a mark (not a slot): the `expect` of a read, or of a first write
#: uuid5 namespace of the slots' task ids.
SLOT_NAMESPACE = uuid.UUID("6f6b3c2e-9a51-5d0b-8c1e-0f4a1b2c3d4e")


def aware(sched: BaseSchedule, dt: datetime) -> datetime:
    """`dt` made aware in `sched`'s timezone, as Celery does."""
    return sched.maybe_make_aware(dt)  # type: ignore[no-any-return]


def last_cron_fire(cron: crontab, now: datetime) -> datetime:
    """The latest time at or before `now` at which `cron` fires, in the crontab's timezone."""
    tz: tzinfo = cron.tz
    wall = aware(cron, now).astimezone(tz).replace(tzinfo=None)
    today = wall.date()
    for back in range(CRON_LOOKBACK_DAYS):
        day: date = today - timedelta(days=back)
        if not (
            day.month in cron.month_of_year
            and day.day in cron.day_of_month
            and day.isoweekday() % 7 in cron.day_of_week
        ):
            continue
        for hour in sorted(cron.hour, reverse=True):
            if back == 0 and hour > wall.hour:
                continue
            latest = wall.minute if back == 0 and hour == wall.hour else 59
            minutes = [m for m in cron.minute if m <= latest]
            if minutes:
                return datetime.combine(day, time(hour, max(minutes)), tzinfo=tz)
    raise ValueError(f"{cron!r} does not fire in the {CRON_LOOKBACK_DAYS} days before {now}")


def interval_slot(run_every: timedelta, now: datetime) -> datetime:
    """The start of the epoch-aligned period of length `run_every` that contains `now`."""
    period = run_every.total_seconds()
    if period <= 0:
        raise ValueError(f"interval must be positive, got {run_every}")
    start = math.floor(now.timestamp() / period) * period
    return datetime.fromtimestamp(start, UTC)


def slot_time(entry: ScheduleEntry, now: datetime) -> datetime:
    """The scheduled time of the run of `entry` that is due at `now` (aware, UTC)."""
    sched = entry.schedule
    if isinstance(sched, crontab):
        at = last_cron_fire(sched, now)
    elif isinstance(sched, schedule):
        at = interval_slot(sched.run_every, aware(sched, now))
    else:
        remaining = sched.remaining_estimate(aware(sched, entry.last_run_at))
        at = (aware(sched, now) + min(remaining, timedelta(0))).replace(microsecond=0)
    return at.astimezone(UTC)


def format_slot(at: datetime) -> str:
    """ISO-8601 UTC with a Z, to the second (microseconds only if the slot has them)."""
    spec = "microseconds" if at.microsecond else "seconds"
    return at.astimezone(UTC).replace(tzinfo=None).isoformat(timespec=spec) + "Z"


def missed_slots(entry: ScheduleEntry, now: datetime, since: datetime) -> list[datetime]:
    """The slots of `entry` after `since` and before its slot due at `now`, oldest first (UTC;
    the latest MAX_CATCHUP_SLOTS). Interval and crontab entries only: a solar event has no
    grid to walk back."""
    sched = entry.schedule
    current = slot_time(entry, now)
    slots: list[datetime] = []
    if isinstance(sched, crontab):
        at = current
        while len(slots) < MAX_CATCHUP_SLOTS:
            try:  # a crontab fires on whole minutes: the one before is a minute back or more
                at = last_cron_fire(sched, at - timedelta(minutes=1)).astimezone(UTC)
            except ValueError:
                break
            if at <= since:
                break
            slots.append(at)
    elif isinstance(sched, schedule):
        at = current - sched.run_every
        while at > since and len(slots) < MAX_CATCHUP_SLOTS:
            slots.append(at)
            at -= sched.run_every
    return slots[::-1]


def slot_key(entry: ScheduleEntry, now: datetime) -> str:
    """The idempotency key of the run of `entry` due at `now`: `"<entry name>@<slot>"`."""
    return f"{entry.name}@{format_slot(slot_time(entry, now))}"


def parse_slot(text: str) -> datetime | None:
    """A slot written by `format_slot`, or None if `text` is not one."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        return None
    return at.astimezone(UTC) if at.tzinfo is not None else None


def slot_task_id(fleet: str, task: str, key: str) -> str:
    """The task id of the slot keyed `key` of `task`: the same in every beat of the fleet
    (key prefix), so every dispatch of one slot is one run, whatever its lifetime."""
    return str(uuid.uuid5(SLOT_NAMESPACE, f"{fleet}\n{task}\n{key}"))


def mark_key(leader_key: str, entry_name: str) -> str:
    """The lock-server key of an entry's last dispatched slot (the name hashed: an entry's
    name may hold characters a key may not)."""
    return f"{leader_key}:slot:{hashlib.sha256(entry_name.encode()).hexdigest()[:24]}"


def read_mark_flow(key: str) -> Flow[str | None]:
    """The stored mark of `key`, or None. A compare-and-set that can only remove NO_MARK
    (never stored): a read in one round trip on every store."""
    kept: str | None = yield SwapPublish(key, NO_MARK, None, MARK_TTL)
    return kept


def advance_mark_flow(key: str, at: datetime, seen: str | None) -> Flow[datetime]:
    """Store slot `at` as `key`'s mark unless a later slot is stored; return the stored
    slot. `seen` is the value last read, so a beat that died between two writes, or a frozen
    one, never moves the mark back."""
    new, expect = format_slot(at), seen or NO_MARK
    for _ in range(MARK_ATTEMPTS):
        kept: str | None = yield SwapPublish(key, expect, new, MARK_TTL)
        if kept is None:
            return at
        other = parse_slot(kept)
        if other is not None and other >= at:
            return other
        expect = kept  # an older slot, or not a slot at all: replace it
    return at


def catchup_since(
    now: datetime, window: float, fleet_last: datetime | None, local_last: datetime
) -> datetime:
    """Where a new leader's catch-up starts: after the slot the fleet last dispatched (the
    lock server's mark), but no earlier than `window` seconds before `now`. With no mark
    (the fleet never dispatched the entry) after this beat's own last run instead."""
    floor = now - timedelta(seconds=window)
    return max(floor, fleet_last if fleet_last is not None else local_last)

