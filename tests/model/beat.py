"""The model's beat: jobfence schedulers in-process on the worker's lock server, a virtual clock.

A sequence's first beat step starts a fleet of one entry (every PERIOD of virtual time) that
sends the sequence's option task, one job per slot (its job id names the slot). The steps:

* ``beat_tick``: the virtual clock moves one period; the leader sends the slot due;
* ``beat_restart(seconds)``: the leader is killed (its lease not released, its keeper
  stopped) and a new beat process starts ``seconds`` of virtual time later, alone: it
  waits out the dead lease, then catches up the slots that fell meanwhile;
* ``beat_handover(seconds)``: the same, but a standby started with the fleet takes over; the
  frozen leader then wakes, and must send nothing.

``at="unmarked"`` kills the leader between a slot's publish and the write of its mark on
the lock server, so its successor sends that slot again (same task id). What each beat sent
is recorded as the sequence's publishes, so the scenario's invariants apply to every slot;
:meth:`BeatFleet.check` adds ``beat-slot-lost`` (a slot within the catch-up window never
sent) and ``beat-slot-twice`` (a slot's job ran or took effect twice, under any lifetime: every
copy of a slot is one run).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery.beat import ScheduleEntry
from celery.schedules import schedule
from hypothesis import strategies as st
from hypothesis.stateful import rule

from jobfence.locks import LeaseKeeper
from jobfence.worker.beat import LeaderScheduler, format_slot, interval_slot

if TYPE_CHECKING:
    from tests.model.scenario import Job, Scenario, Step, Violation

__all__ = ["BEAT_STEPS", "BeatFleet", "BeatRules", "ModelScheduler", "VirtualClock"]

#: The entry's interval, in virtual time.
PERIOD = timedelta(seconds=1)
#: The beats' lease TTL, in real seconds: a dead leader's lease lapses this soon.
BEAT_TTL = 0.6
#: How far back a new leader catches up, in virtual seconds: beyond every gap a step makes
#: (the clock moves at most 3 s, and one period more at an "unmarked" kill).
CATCHUP = 6.0
#: The virtual time the fleet starts at: mid-period, so its first slot is the next.
START = datetime(2030, 1, 1, 0, 0, 0, 500000, tzinfo=UTC)
#: How long (real seconds) a beat may take to lead once the dead lease lapsed: a deadline,
#: not a measure (the suite and two fuzzers on 2 cores: past 6 s once, 2026-11-29).
ELECT_TIMEOUT = 25 * BEAT_TTL
#: Steps after which a body may rightly run again (a delivery again, its effect replayed).
RERUN_STEPS = frozenset({"lose_leases", "blip", "flush", "redeliver", "cut_db", "rotate", "fork"})
#: The steps this module runs (Scenario._do_<kind> delegate to BeatFleet.<kind>).
BEAT_STEPS = ("beat_tick", "beat_restart", "beat_handover")


class VirtualClock:
    """The schedules' notion of now, moved by the steps."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class ModelScheduler(LeaderScheduler):
    """A LeaderScheduler whose entry's message carries the job of its slot, and that tells
    the fleet what it sent (or what its publish raised)."""

    beats_of: BeatFleet  # not `fleet`: LeaderScheduler's (the key prefix)
    #: Drop the writes of the marks: a beat killed between a publish and its mark's write.
    drop_marks = False

    def install_default_entries(self, data: Any) -> None:
        """None: the model's fleet runs its one entry only."""

    def dispatch_slot(
        self, entry: ScheduleEntry, at: datetime, producer: Any = None, **kwargs: Any
    ) -> Any:
        job = self.beats_of.slot_job(at)
        stamped = copy.copy(entry)
        stamped.args = self.beats_of.scenario.args_of(job)
        try:
            result = super().dispatch_slot(stamped, at, producer=producer, **kwargs)
        except Exception as exc:  # Celery wraps the publish's error in a SchedulingError
            cause = exc.__cause__ or exc.__context__ or exc
            self.beats_of.sent(job, None, type(cause).__name__)
            raise
        self.beats_of.sent(job, result.id, None)
        return result

    def record_slot(self, entry: ScheduleEntry, at: datetime) -> None:
        if not self.drop_marks:
            super().record_slot(entry, at)


class BeatFleet:
    """The beats of one sequence: a leader, a standby, the dead; the slots they sent."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.clock = VirtualClock(START)
        self.entry_name = f"{scenario.prefix}beat"
        self.leader_key = f"{scenario.prefix}beat-leader"
        self.hold = 0.02
        self.faults: list[str] = []
        self.slot_jobs: dict[str, Job] = {}
        self.dispatched: list[tuple[str, str | None, str | None]] = []
        self.beats: list[ModelScheduler] = []
        self.leader = self._start()
        self.standby = self._start()  # started with the fleet: its entry last ran at START
        self._lead(self.leader)
        self.standby.tick()
        assert not self.standby.is_leader, "two beats lead at once"

    # -- the beats -------------------------------------------------------------------

    def _start(self) -> ModelScheduler:
        """A beat process started now (virtual): its entry last ran at its start."""
        app = self.scenario.harness.model.app
        sched = ModelScheduler(
            app, keeper=LeaseKeeper(fraction=1 / 3), leader_key=self.leader_key, ttl=BEAT_TTL,
            lazy=True,
        )  # fmt: skip
        sched.beats_of = self
        sched.catchup = CATCHUP
        sched.schedule[self.entry_name] = ScheduleEntry(
            name=self.entry_name,
            task=self.scenario.options.task_name,
            schedule=schedule(PERIOD, nowfun=self.clock, app=app),
            last_run_at=self.clock.now,
            app=app,
        )
        self.beats.append(sched)
        return sched

    def _lead(self, sched: ModelScheduler) -> None:
        """Tick `sched` as `celery beat` does until it leads (a dead lease lapses in
        BEAT_TTL real seconds), then until nothing is due."""
        deadline = time.monotonic() + ELECT_TIMEOUT
        sched.tick()
        while not sched.is_leader:
            if time.monotonic() > deadline:
                raise AssertionError(f"no beat led within {ELECT_TIMEOUT:g}s")
            time.sleep(sched.standby_poll)  # as a standby polls
            sched.tick()
        self._settle(sched)

    def _settle(self, sched: ModelScheduler) -> None:
        """Tick until nothing is due (a tick sends one due entry and asks to come back at once)."""
        for _ in range(4 * int(CATCHUP) + 20):
            if sched.tick() > 0:
                return
        raise AssertionError("the beat never came to rest")

    def _kill(self, sched: ModelScheduler, unmarked: bool) -> None:
        """SIGKILL, in effect: no release, no more heartbeats. ``unmarked``: it dies after
        sending the next slot and before storing it as the fleet's last."""
        if unmarked:
            self.clock.now += PERIOD
            sched.drop_marks = True
            self._settle(sched)
        sched.keeper.stop()

    # -- the steps -------------------------------------------------------------------

    def beat_tick(self, step: Step) -> None:
        self.hold = step.hold
        self.clock.now += PERIOD
        self._settle(self.leader)

    def beat_restart(self, step: Step) -> None:
        """The leader killed; `celery beat` started again `seconds` later, no standby's help."""
        self.hold = step.hold
        self._kill(self.leader, step.at == "unmarked")
        self.clock.now += timedelta(seconds=step.seconds)
        self.leader = self._start()
        self._lead(self.leader)
        self._standby_tick()

    def _standby_tick(self) -> None:
        """The standby polls once. It leads only if the leader's lease lapsed meanwhile (its
        keeper starved on a loaded machine): then it has taken over, as a fleet's standby
        does, and the two swap roles; the steps after act on the beat that leads (a long run
        under load: the next restart waited on a beat that no longer led)."""
        self.standby.tick()
        if self.standby.is_leader:
            self.leader, self.standby = self.standby, self.leader

    def beat_handover(self, step: Step) -> None:
        """The leader frozen (no release); the standby takes over; the old one wakes."""
        self.hold = step.hold
        old = self.leader
        self._kill(old, step.at == "unmarked")
        self.clock.now += timedelta(seconds=step.seconds)
        self.leader, self.standby = self.standby, old
        self._lead(self.leader)
        # A freeze ends past the frozen term's local deadline (it is what froze the leader
        # out). The successor waits that long for the lease to lapse, unless a flush erased
        # it and the successor was elected at once: then the freeze lasts until the deadline.
        deadline = time.monotonic() + 2 * BEAT_TTL
        while old.is_leader and time.monotonic() < deadline:
            time.sleep(0.02)
        before = len(self.dispatched)
        old.tick()  # it wakes: its term is over, it must not send
        if old.is_leader or len(self.dispatched) != before:
            if self.leader.is_leader:  # both lead at once: the split brain this step is about
                self.faults.append("a frozen leader sent or led after its successor took over")
            elif old.is_leader:
                # The successor's lease lapsed first (its keeper starved on a loaded machine:
                # a lease that lapsed on the server passed its local deadline before), and the
                # woken one was elected afresh, a term of its own; the steps after act on it.
                self.leader, self.standby = old, self.leader
                old.drop_marks = False
                return
        # the woken one runs on as the standby, a beat process of its own
        old.keeper = LeaseKeeper(fraction=1 / 3)
        old.drop_marks = False

    def close(self) -> None:
        """Stop every beat (the living release their lease)."""
        for sched in self.beats:
            try:
                sched.close()
            finally:
                sched.keeper.stop()

    # -- what was sent -----------------------------------------------------------------

    def slot_job(self, at: datetime) -> Job:
        from tests.model.scenario import Job

        name = format_slot(at)
        job = self.slot_jobs.get(name)
        if job is None:
            job = self.slot_jobs[name] = Job(f"{self.scenario.prefix}beat@{name}", "ok", self.hold)
        return job

    def sent(self, job: Job, task_id: str | None, refused: str | None) -> None:
        from tests.model.scenario import Publish

        self.scenario.publishes.append(Publish(job, "beat", task_id=task_id, refused=refused))
        self.dispatched.append((job.job_id, task_id, refused))

    def expected_slots(self) -> list[str]:
        """Every slot that fell after the fleet's start, up to now (every gap is within the
        catch-up window, and every step ends with the current slot sent)."""
        now = interval_slot(PERIOD, self.clock.now)
        at, slots = interval_slot(PERIOD, START) + PERIOD, []
        while at <= now:
            slots.append(format_slot(at))
            at += PERIOD
        return slots

    def check(self, effects: list[dict[str, Any]]) -> list[Violation]:
        from tests.model.scenario import Violation

        found = [Violation("beat-split-brain", fault) for fault in self.faults]
        sent = {job_id for job_id, _, _ in self.dispatched}
        # A flush erases the fleet's marks and the leader's lease: a slot may then fall
        # outside what any beat knows it owes (the window starts at the new term's start).
        if not any(s.kind == "flush" for s in self.scenario.steps):
            found += [
                Violation("beat-slot-lost", f"slot {name} was never sent")
                for name in self.expected_slots()
                if f"{self.scenario.prefix}beat@{name}" not in sent
            ]
        counts = Counter(e["job_id"] for e in effects if e["job_id"] in sent)
        found += [
            Violation("beat-slot-twice", f"{job_id} took effect {n} times")
            for job_id, n in counts.items()
            if n > 1
        ]
        rerun = bool({s.kind for s in self.scenario.steps} & RERUN_STEPS)
        # A delivery whose lease lapsed mid-body (its keeper starved past the TTL on a loaded
        # machine, per the decision log) is run again as after `lose_leases`: its effect
        # still once (counted above), its body twice.
        if not rerun and not self.scenario._lapsed_holders():
            # The fenced effect's DONE row replays a second run's effect: count the runs
            # themselves, the bodies entered (no step here delivers a message again).
            slot_of = {task_id: job_id for job_id, task_id, _ in self.dispatched if task_id}
            runs = Counter(
                slot_of[e["task_id"]]
                for e in self.scenario.harness.model.slot_events(self.scenario.group)
                if e["kind"] == "enter" and e["task_id"] in slot_of
            )
            found += [
                Violation("beat-slot-twice", f"{job_id} ran {n} times")
                for job_id, n in runs.items()
                if n > 1 and counts[job_id] <= 1
            ]
        return found


#: Virtual seconds between a kill and the next beat's start (all within CATCHUP).
GAPS = st.sampled_from([0.5, 1.5, 3.0])
#: Where the leader dies: between two slots, or after a publish and before its mark.
KILLS = st.sampled_from(["", "unmarked"])
BEAT_HOLDS = st.sampled_from([0.02, 0.02, 0.4])


class BeatRules:
    """The beat's rules, mixed into a machine of the redis harness only (machine_for): the
    memory harness's rule list, and its derandomized sequences, stay as they were."""

    _run: Callable[[Step], None]  # ModelMachine's

    @rule(hold=BEAT_HOLDS)
    def beat_tick(self, hold: float) -> None:
        from tests.model.scenario import Step

        self._run(Step("beat_tick", hold=hold))

    @rule(seconds=GAPS, at=KILLS)
    def beat_restart(self, seconds: float, at: str) -> None:
        from tests.model.scenario import Step

        self._run(Step("beat_restart", seconds=seconds, at=at))

    @rule(seconds=GAPS, at=KILLS)
    def beat_handover(self, seconds: float, at: str) -> None:
        from tests.model.scenario import Step

        self._run(Step("beat_handover", seconds=seconds, at=at))
