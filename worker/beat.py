"""Beat leader election on the lock backend, and one identity per (entry, scheduled slot).

Any number of `celery beat` processes may run. Each tick a beat that does not lead tries
once to be elected on the key "beat-leader" (jobfence.locks.leader, the election any
singleton process uses); the leader's term is kept by the LeaseKeeper, and it dispatches
only while the term lasts. Election is the fast path: a frozen leader can outlive its lease
and dispatch beside its successor. So every dispatch of a slot is the same run whoever sends
it: its idempotency key is `"<entry name>@<slot>"` (the slot being the scheduled time of
that run, ISO-8601 UTC) and its task id is derived from that key, so a @singleton_task runs
each slot once under every lifetime (a per-run lifetime's record answers its own task id).

Slots (worker/beat_slots.py): an interval entry runs on the epoch-aligned grid (every 10 s
means at :00, :10, ...), so beats started at different times agree; a crontab entry's slot is
its latest firing time at or before now; other schedules (solar) fall back to their due time.

Hand-over: the leader stores, per entry, the last slot it dispatched on the lock server (a
mark under the leader key). A new leader first dispatches the interval and crontab slots
after that mark and within the catch-up window before now (`jobfence_beat_catchup`, default
two leader TTLs), oldest first, then the current slot unless the mark has it: the slots that
fell while no leader was dispatching, however late this process started. With no mark (the
fleet never dispatched the entry) the window starts at this beat's own last run, and the
leader stores the slot of that run as the mark before it dispatches anything (so a leader
killed before its first mark was written still leaves its successor where to start).
"""

from __future__ import annotations

import copy
import heapq
import logging
import math
from datetime import datetime
from typing import Any

from celery.beat import ScheduleEntry, Scheduler, event_t
from celery.schedules import crontab, schedstate, schedule

from jobfence.locks import LeaseKeeper, LockBackend, LockError
from jobfence.locks.backend import default_meta
from jobfence.locks.drive import run_sync
from jobfence.locks.leader import Term, try_elect
from jobfence.locks.lease import Lease
from jobfence.locks.outage import OUTAGE
from jobfence.tasks import HEADER, SingletonTask, runtime_for
from jobfence.worker.beat_slots import CRON_LOOKBACK_DAYS as CRON_LOOKBACK_DAYS
from jobfence.worker.beat_slots import MARK_ATTEMPTS as MARK_ATTEMPTS
from jobfence.worker.beat_slots import MARK_TTL as MARK_TTL
from jobfence.worker.beat_slots import MAX_CATCHUP_SLOTS as MAX_CATCHUP_SLOTS
from jobfence.worker.beat_slots import NO_MARK as NO_MARK
from jobfence.worker.beat_slots import SLOT_NAMESPACE as SLOT_NAMESPACE
from jobfence.worker.beat_slots import advance_mark_flow as advance_mark_flow
from jobfence.worker.beat_slots import aware
from jobfence.worker.beat_slots import catchup_since as catchup_since
from jobfence.worker.beat_slots import format_slot as format_slot
from jobfence.worker.beat_slots import interval_slot as interval_slot
from jobfence.worker.beat_slots import last_cron_fire as last_cron_fire
from jobfence.worker.beat_slots import mark_key as mark_key
from jobfence.worker.beat_slots import missed_slots as missed_slots
from jobfence.worker.beat_slots import parse_slot as parse_slot
from jobfence.worker.beat_slots import read_mark_flow as read_mark_flow
from jobfence.worker.beat_slots import slot_key as slot_key
from jobfence.worker.beat_slots import slot_task_id as slot_task_id
from jobfence.worker.beat_slots import slot_time as slot_time

log = logging.getLogger(__name__)

LEADER_KEY = "beat-leader"
MAX_STANDBY_POLL = 1.0  # seconds between a standby's attempts, at most


def _catchup_window(value: Any, ttl: float) -> float:
    """`jobfence_beat_catchup` in seconds (None: two leader TTLs), checked."""
    if value is None:
        return 2 * ttl
    try:
        window = float(value)
    except (TypeError, ValueError):
        window = math.nan
    if not math.isfinite(window) or window < 0:
        raise ValueError(
            f"jobfence_beat_catchup must be a finite number of seconds >= 0, got {value!r}; "
            "set it to how far back a new beat leader dispatches missed slots (0: none)"
        )
    return window


# --------------------------------------------------------------------------- scheduler


class LeaderScheduler(Scheduler):  # type: ignore[misc]
    """A beat Scheduler that dispatches only while it holds the leader lease.

    Celery settings (optional): `jobfence_beat_leader_key` (default "beat-leader"),
    `jobfence_beat_ttl` (default JOBFENCE_DEFAULT_TTL), `jobfence_beat_catchup` (seconds,
    default two TTLs: how far back a new leader dispatches the slots it missed). A standby
    polls every min(ttl/3, 1 s), so it takes over at most about one TTL after the leader
    died, and at once after a leader that shut down cleanly (it releases the lease).
    """

    _heap: list[Any] | None

    def __init__(
        self,
        app: Any,
        *args: Any,
        backend: LockBackend | None = None,
        keeper: LeaseKeeper | None = None,
        leader_key: str | None = None,
        ttl: float | None = None,
        **kwargs: Any,
    ) -> None:
        runtime = runtime_for(app)
        self.backend = backend or runtime.backend
        self.keeper = keeper or runtime.keeper
        self.leader_key = leader_key or app.conf.get("jobfence_beat_leader_key") or LEADER_KEY
        self.ttl = float(ttl or app.conf.get("jobfence_beat_ttl") or runtime.settings.default_ttl)
        self.standby_poll = min(self.ttl / 3, MAX_STANDBY_POLL)
        self.catchup = _catchup_window(app.conf.get("jobfence_beat_catchup"), self.ttl)
        self._catching_up = False  # set by a new term: dispatch the missed slots first
        self.fleet = runtime.settings.key_prefix  # beats that share it share slot task ids
        self._marks: dict[str, str] = {}  # entry name -> its mark as last read or written
        self.observer = runtime.metrics.observe_leadership
        self.term: Term | None = None
        self._standby_logged = False
        super().__init__(app, *args, **kwargs)

    # -- election ----------------------------------------------------------------
    @property
    def lease(self) -> Lease | None:
        """The lease of the current (or just ended) term."""
        return self.term.lease if self.term is not None else None

    @property
    def is_leader(self) -> bool:
        return self.term is not None and self.term.leading

    def elect(self) -> bool:
        """Keep or take the lead (jobfence.locks.leader); True while this scheduler leads."""
        if self.term is not None:
            if self.term.leading:
                return True
            log.warning("beat: lost the leader lease %r; dispatching stops", self.leader_key)
            # Owner-checked: frees the key at once if it is in fact still ours (a late
            # heartbeat), and does nothing if a successor holds it.
            self._let_go()
        try:
            term = try_elect(
                self.backend,
                self.keeper,
                self.leader_key,
                ttl=self.ttl,
                meta=default_meta(task_name="celery.beat"),
                observer=self.observer,
            )
        except LockError as exc:
            OUTAGE.warning(log, "beat: cannot reach the lock backend for the election: %s", exc)
            return False
        if term is None:
            if not self._standby_logged:
                log.info("beat: standing by; another beat holds %r", self.leader_key)
                self._standby_logged = True
            return False
        self.term = term
        self._standby_logged = False
        self._heap = None  # re-evaluate every entry: some may have fallen due meanwhile
        self._catching_up = True
        log.info(
            "beat: leading (lease %r, fence %d, ttl %gs)", self.leader_key, term.fence, self.ttl
        )
        return True

    def _let_go(self) -> None:
        """End the term: stop keeping the lease and release it (owner-checked)."""
        term, self.term = self.term, None
        if term is not None:
            term.resign()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self.elect():
            return self.standby_poll
        if self._catching_up:
            self._catching_up = False
            self.catch_up()
        return float(super().tick(*args, **kwargs))

    def catch_up(self) -> None:
        """Dispatch each entry's slots that fell after the fleet's last dispatch of it (its
        mark on the lock server) and within the catch-up window, oldest first; the current
        slot is left to the tick, which sends it unless the mark has it."""
        for entry in list(self.schedule.values()):
            now = aware(entry.schedule, entry.default_now())
            try:
                fleet_last = self.fleet_last_slot(entry, now)
                local_last = aware(entry.schedule, entry.last_run_at)
                since = catchup_since(now, self.catchup, fleet_last, local_last)
                slots = missed_slots(entry, now, since)
            except Exception as exc:  # one broken schedule must not stop the others
                log.error("beat: cannot list the missed slots of %s: %r", entry.name, exc)
                continue
            if fleet_last is not None and isinstance(entry.schedule, crontab | schedule):
                # The tick's is_due reads last_run_at: from the fleet's last slot, the
                # current one is due unless it was dispatched (this beat's own start time
                # would say "not due" if it started within the current period).
                entry.last_run_at = fleet_last
            elif fleet_last is None and isinstance(entry.schedule, crontab | schedule):
                # No mark: the fleet starts covering the entry here. Store where (the slot
                # at this beat's start, owed to nobody) before any dispatch, so a leader
                # killed between its first publish and that slot's mark leaves its
                # successor a mark to catch up from, not a mark-less window that starts at
                # the successor's own start (issue 29: the slots between were lost).
                self.record_slot(entry, slot_time(entry, local_last))
            for at in slots:
                try:
                    self.dispatch_slot(entry, at)
                except Exception as exc:  # as Celery's tick: log, and go on with the rest
                    log.error("beat: catching up %s at %s failed: %r", entry.name, at, exc)

    def fleet_last_slot(self, entry: ScheduleEntry, now: datetime) -> datetime | None:
        """The latest slot of `entry` the fleet dispatched, from the lock server (None: never,
        unreadable, or not yet due here: a mark ahead of this beat's clock)."""
        try:
            kept = run_sync(
                read_mark_flow(mark_key(self.leader_key, entry.name)),
                self.backend,
                self.backend.clock,
            )
        except LockError as exc:
            OUTAGE.warning(log, "beat: cannot read the last slot of %s: %s", entry.name, exc)
            return None
        if kept is None:
            return None
        self._marks[entry.name] = kept
        at = parse_slot(kept)
        return at if at is not None and at <= now else None

    def record_slot(self, entry: ScheduleEntry, at: datetime) -> None:
        """Store `at` as the fleet's last dispatched slot of `entry` (after its dispatch: a
        mark never names a slot that was not sent)."""
        key = mark_key(self.leader_key, entry.name)
        try:
            stored = run_sync(
                advance_mark_flow(key, at, self._marks.get(entry.name)),
                self.backend,
                self.backend.clock,
            )
        except LockError as exc:  # a successor re-sends the slot: the same run, absorbed
            OUTAGE.warning(log, "beat: cannot store the last slot of %s: %s", entry.name, exc)
            return
        self._marks[entry.name] = format_slot(stored)

    def close(self) -> None:
        """Release the lease (a standby takes over at its next poll), then close as usual."""
        try:
            self._let_go()
        finally:
            super().close()

    # -- slots -------------------------------------------------------------------
    def is_due(self, entry: ScheduleEntry) -> schedstate:
        """Interval entries run on the epoch-aligned grid; others as Celery decides."""
        sched = entry.schedule
        if isinstance(sched, crontab) or not isinstance(sched, schedule):
            return entry.is_due()
        period = sched.run_every.total_seconds()
        now = aware(sched, sched.now()).timestamp()
        last = aware(sched, entry.last_run_at).timestamp()
        current = math.floor(now / period)
        return schedstate(current > math.floor(last / period), (current + 1) * period - now)

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        """Like Celery's, but with this scheduler's `is_due` (the aligned grid)."""
        heap: list[Any] = []
        for entry in self.schedule.values():
            try:
                is_due, next_call = self.is_due(entry)
            except Exception:
                is_due, next_call = self._is_due_failed(entry)
            heap.append(event_t(self._when(entry, 0 if is_due else next_call) or 0, 5, entry))
        heapq.heapify(heap)
        self._heap = heap

    def apply_async(
        self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Publish `entry` with the idempotency key of its slot in the message headers."""
        at = slot_time(entry, entry.default_now())
        if advance:
            entry = self.reserve(entry)
        return self.dispatch_slot(entry, at, producer=producer, **kwargs)

    def dispatch_slot(
        self, entry: ScheduleEntry, at: datetime, producer: Any = None, **kwargs: Any
    ) -> Any:
        """Publish the run of `entry` scheduled at `at`, keyed `"<entry name>@<slot>"`, under
        the slot's own task id; then store it as the fleet's last dispatched slot."""
        key = f"{entry.name}@{format_slot(at)}"
        stamped = copy.copy(entry)
        headers = dict(entry.options.get("headers") or {})
        headers[HEADER] = key
        task_id = slot_task_id(self.fleet, str(entry.task), key)
        stamped.options = {**entry.options, "headers": headers, "task_id": task_id}
        log.info("beat: dispatching %s as %s (task %s)", entry.task, key, task_id)
        result = super().apply_async(stamped, producer=producer, advance=False, **kwargs)
        self.record_slot(entry, at)
        return result

    def setup_schedule(self) -> None:
        super().setup_schedule()
        for entry in self.schedule.values():
            task = self.app.tasks.get(entry.task)
            if (
                task is not None
                and not isinstance(task, SingletonTask)
                and not str(entry.task).startswith("celery.")
            ):
                log.warning(
                    "beat: periodic task %s is not a @singleton_task: two beats (or a frozen "
                    "leader) could run one slot twice",
                    entry.task,
                )

    @property
    def info(self) -> str:
        return (
            f"    . leader election: {self.leader_key!r} on {self.backend.name}, ttl {self.ttl:g}s"
        )
