"""One model sequence: steps run against the live worker, a bounded drain, then the invariants.

A sequence is plain data (an option combination and a list of steps, see :class:`Step`), so
the hypothesis machine and the seed database (``seeds.json``) replay it through the same
code. :meth:`Scenario.check` returns every violation found, each named by its class.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from celery import chain
from celery.result import AsyncResult
from celery.worker import state as worker_state

from jobfence.config import Settings
from jobfence.locks.decisions import DecisionLog
from jobfence.tasks import DuplicatePublish, runtime_for
from jobfence.tasks.publish import published_at
from tests.model.app import REDELIVERY_LIMIT, ModelApp, Options
from tests.model.second import BEGIN_TIMEOUT, QUEUE, SecondWorker
from tests.pg_cut import SessionCutter
from tests.servers import RedisServer

if TYPE_CHECKING:
    from jobfence.worker.outbox_relay import OutboxRelay
    from tests.model.beat import BeatFleet

__all__ = [
    "CUT_AT",
    "DRAIN_TIMEOUT",
    "FAULTS",
    "Harness",
    "Job",
    "Publish",
    "Scenario",
    "Step",
    "Violation",
]

#: How long the drain waits for every AsyncResult to be ready and the worker to be idle.
DRAIN_TIMEOUT = 20.0
#: The longest a drain may take while results keep getting ready.
DRAIN_LIMIT = 120.0
#: How long a forked child may take to store its decisions and close (far above the ms it needs).
FORK_DEADLINE = 10.0
#: How long a rotation waits for the deliveries begun before it (its step 1's restart).
ROTATE_TIMEOUT = 20.0
#: Steps that break the lease or the lock server's data (they allow a given-up job).
FAULTS = frozenset({"lose_leases", "blip", "flush"})
#: Where a ``cut_db`` step kills the effects database's session: before each statement the
#: effect's transaction sends on PostgreSQL (psycopg sends BEGIN with the first), by the
#: text of its SQL. A replay (its DONE row found) sends the first two, then its COMMIT.
CUT_AT = {
    "fence": "INSERT INTO jobfence_fences",  # the fence's check-and-advance: one upsert
    "lookup": "FROM jobfence_jobs",  # the DONE row looked up
    "effect": "INSERT INTO model_effects",  # the body's own insert
    "done": "INSERT INTO jobfence_jobs",  # the DONE row inserted
    "commit": "COMMIT",
}
#: Failures a caller may see without a fault or a failing body: ``on_conflict="raise"``.
CONFLICT_ERRORS = frozenset({"DuplicateJob", "DuplicatePublish"})
#: Failures allowed after a fault: given up after the redelivery limit or the crash cap.
#: The crash cap (JOBFENCE_MAX_CRASHED_DELIVERIES, default): a sequence with that many
#: ``kill_worker`` steps may leave a job caught by each, given up as a poison message.
CRASH_CAP = int(Settings.model_fields["max_crashed_deliveries"].default)
GIVEN_UP_ERRORS = frozenset({"RedeliveryLimitReached", "PoisonMessage"})
#: Typed stops (``JobSkipped`` and its subclasses): a delivery with no result of its own, a
#: recorded FAILURE its caller can tell apart from a result; the job took effect elsewhere.
STOPS = frozenset(
    {"JobSkipped", "DuplicateSkipped", "JobSuperseded", "JobDropped", "RateLimitSkipped"}
)


#: Decisions that say a delivery's body ran (its effect may have committed).
RAN_EVENTS = frozenset(
    {"started", "done", "failed", "released", "lease_lost", "superseded", "stale", "redeliver",
     "given_up", "poisoned", "commit_refused", "effect_replayed"}
)


@dataclass(frozen=True)
class Step:
    """One action: ``publish`` / ``duplicate`` / ``redeliver`` / ``chain`` take ``job`` (an
    index into the jobs published so far, modulo their number; ``publish`` makes a new one
    with ``mode`` and ``hold``); ``countdown`` delays a publish; ``blip`` pauses the lock
    server for ``seconds``; ``sleep`` lets time pass; ``rotate`` starts a key-secret
    rotation (``seconds``: how late each record read answers); ``cut_db`` kills the effects
    database's session at statement ``at`` (a key of CUT_AT) of the next effect transaction
    that sends it; ``lose_leases``, ``flush`` and ``fork`` take none; ``pause_worker`` and
    ``kill_worker`` route a new job with ``hold`` to the worker processes (redis harness),
    then pause its holder for ``seconds`` or kill them all; ``on_commit`` publishes a new
    job through the outbox, ``at`` "commit", "rollback" or "died" (before its publish)."""

    kind: str
    job: int = 0
    mode: str = "ok"
    hold: float = 0.02
    countdown: float | None = None
    seconds: float = 0.0
    at: str = ""

    def to_json(self) -> dict[str, Any]:
        default = Step(self.kind)
        return {k: v for k, v in asdict(self).items() if k == "kind" or v != getattr(default, k)}


@dataclass(frozen=True)
class Job:
    job_id: str
    mode: str
    hold: float


@dataclass
class Publish:
    """One publish as its caller saw it: the AsyncResult id, or the error it raised."""

    job: Job
    kind: str
    task_id: str | None = None
    refused: str | None = None
    tail_id: str | None = None


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass
class Harness:
    """The live worker's app and, on the Redis backend, the lock server the faults hit and
    the cutter of its PostgreSQL effects database's sessions (SQLite on the memory backend)."""

    model: ModelApp
    backend: str
    broker: RedisServer
    locks: RedisServer | None = None
    cutter: SessionCutter | None = None
    #: The redis harness's second worker process (pause_worker, kill_worker); None elsewhere.
    second: SecondWorker | None = None
    #: The fleet's outbox relay (``on_commit`` steps); None where a test built no harness.
    relay: OutboxRelay | None = None


@dataclass
class Scenario:
    """Runs the steps of one sequence on a fresh namespace of job ids and one option set."""

    harness: Harness
    options: Options
    prefix: str = field(default_factory=lambda: f"m{uuid.uuid4().hex[:10]}-")
    steps: list[Step] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    publishes: list[Publish] = field(default_factory=list)
    fork_faults: list[str] = field(default_factory=list)
    #: Jobs of ``on_commit`` steps whose transaction rolled back: none may take effect.
    rolled_back: list[Job] = field(default_factory=list)
    #: How many cuts had fired before this sequence (the cutter counts for the harness).
    cuts_before: int = 0
    #: Deliveries whose decisions a kill_worker step may have lost (still in their
    #: process's writer, stored every 0.2 s off the job's path: docs/how-to/why.md, "Cost").
    unlogged: set[str] = field(default_factory=set)
    #: When each kill_worker step killed the worker processes (time.monotonic, system-wide).
    kills: list[float] = field(default_factory=list)
    #: The beats of the ``beat_*`` steps (tests/model/beat.py), started by the first one.
    beat: BeatFleet | None = None

    def __post_init__(self) -> None:
        self.harness.model.unrotate()  # every sequence starts under the worker's own secret
        if self.harness.cutter is not None:  # an arming a failed sequence left never fires here
            self.harness.cutter.disarm()
            self.cuts_before = self.harness.cutter.fires

    def cuts_fired(self) -> int:
        """The database sessions this sequence's ``cut_db`` steps killed."""
        cutter = self.harness.cutter
        return 0 if cutter is None else cutter.fires - self.cuts_before

    @property
    def group(self) -> str:
        return self.prefix + "group"

    def describe(self) -> str:
        """The sequence as JSON, ready for ``seeds.json``."""
        return json.dumps(
            {
                "backend": self.harness.backend,
                "options": asdict(self.options),
                "steps": [s.to_json() for s in self.steps],
            }
        )

    # -- steps ----------------------------------------------------------------------

    def run(self, step: Step) -> None:
        self.steps.append(step)
        getattr(self, f"_do_{step.kind}")(step)

    def _args(self, job: Job) -> tuple[str, str, str, float]:
        return (job.job_id, self.group, job.mode, job.hold)

    def args_of(self, job: Job) -> tuple[str, str, str, float]:
        """The task's arguments for `job` (a beat's entry sends them)."""
        return self._args(job)

    def _pick(self, step: Step) -> Job | None:
        return self.jobs[step.job % len(self.jobs)] if self.jobs else None

    def _send(self, job: Job, kind: str, countdown: float | None) -> None:
        task = self.harness.model.tasks[self.options]
        publish = Publish(job, kind)
        try:
            result = task.apply_async(self._args(job), countdown=countdown)
        except DuplicatePublish as exc:
            publish.refused = type(exc).__name__
        else:
            publish.task_id = result.id
        self.publishes.append(publish)

    def _new_job(self, step: Step) -> Job:
        job = Job(f"{self.prefix}{len(self.jobs)}", step.mode, step.hold)
        self.jobs.append(job)
        return job

    def _do_publish(self, step: Step) -> None:
        self._send(self._new_job(step), "publish", step.countdown)

    def _do_duplicate(self, step: Step) -> None:
        job = self._pick(step)
        if job is not None:
            self._send(job, "duplicate", step.countdown)

    def _do_redeliver(self, step: Step) -> None:
        """The same message again, as a broker redelivers it: same task id, past apply_async."""
        job = self._pick(step)
        # Only a message that was sent as a plain one: a publish answered with a chain head's
        # AsyncResult (on_duplicate_publish="result") sent nothing, and a chain head's own
        # message carries its chain (the fuzz run of 2026-11-29: a chainless copy made up
        # under the head's id won the record, and the real head's typed stop failed its tail).
        heads = {p.task_id for p in self.publishes if p.tail_id}
        earlier = [p for p in self.publishes
                   if p.job == job and p.task_id and not p.tail_id and p.task_id not in heads]
        if job is None or not earlier:
            return
        name = self.options.task_name
        self.harness.model.app.send_task(name, self._args(job), task_id=earlier[0].task_id)

    def _do_chain(self, step: Step) -> None:
        """``chain(job, tail)``; ``job < 0``: a new job (its first publish is the chain's)."""
        job = self._new_job(step) if step.job < 0 else self._pick(step)
        if job is None:
            return
        task = self.harness.model.tasks[self.options]
        tail = self.harness.model.app.signature("model.tail", args=(self.prefix,))
        publish = Publish(job, "chain")
        try:
            result = chain(task.s(*self._args(job)), tail).apply_async()
        except DuplicatePublish as exc:
            publish.refused = type(exc).__name__
        else:
            publish.tail_id = result.id
            publish.task_id = result.parent.id if result.parent is not None else None
        self.publishes.append(publish)

    def _do_on_commit(self, step: Step) -> None:
        """A new job published on commit through the outbox (issue 34), its row written in
        a transaction on the effects database: ``at`` "commit" (published after it),
        "rollback" (nothing may run), "died" (the process died between its commit and its
        publish: only the row is left, for the harness's relay to send)."""
        from sqlalchemy.orm import Session

        from jobfence.tasks.outbox import SqlOutbox, entry_for
        from jobfence.tasks.publish import ordered_id

        if step.at == "rollback":  # never among the jobs later steps pick (it never was)
            job = Job(f"{self.prefix}rolled-back-{len(self.rolled_back)}", step.mode, step.hold)
        else:
            job = self._new_job(step)
        task = self.harness.model.tasks[self.options]
        options = {} if step.countdown is None else {"countdown": step.countdown}
        publish = Publish(job, "on_commit")
        web = self.harness.model.web_engine()
        with Session(web) as session:
            if step.at == "died":
                entry = entry_for(task, self._args(job), {}, options, ordered_id())
                SqlOutbox(web).write(session.connection(), entry)
                publish.task_id = entry.task_id
            else:
                publish.task_id = task.apply_async_on_commit(
                    self._args(job), session=session, **options
                ).id
            if step.at == "rollback":
                session.rollback()
                self.rolled_back.append(job)
                return
            session.commit()
        self.publishes.append(publish)

    def _do_sleep(self, step: Step) -> None:
        time.sleep(step.seconds)

    def _do_lose_leases(self, step: Step) -> None:
        """Delete the lock of every job of this sequence that holds one (the admin release)."""
        backend = runtime_for(self.harness.model.app).backend
        for info in list(backend.scan()):
            if info.key.startswith(self.options.task_name + ":"):
                backend.force_release(info.key)

    def _do_blip(self, step: Step) -> None:
        if self.harness.locks is not None:
            with self.harness.locks.suspended():
                time.sleep(step.seconds)

    def _do_fork(self, step: Step) -> None:
        """Fork this process (the worker's threads mid-flight: the keeper, the decision
        writer perhaps storing a batch): the child must store its pending decisions and
        close its recorder within FORK_DEADLINE. A lock or condition held by a thread at the
        fork and not rebuilt in the child hangs it (issue 29, defect 6)."""
        recorder = runtime_for(self.harness.model.app).executor.recorder
        # Where a hung child waits: it writes its threads' stacks here just before the
        # deadline (faulthandler), and the fault names them.
        stacks = tempfile.TemporaryFile()  # noqa: SIM115 (closed below, after the child)
        pid = os.fork()
        if pid == 0:  # the child: no pytest, no assertions; its exit status is the verdict
            code = 1
            try:
                faulthandler.dump_traceback_later(FORK_DEADLINE - 1.0, file=stacks)
                if recorder is not None:
                    recorder.close()
                code = 0
            finally:
                os._exit(code)
        with stacks:
            deadline = time.monotonic() + FORK_DEADLINE
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    if os.waitstatus_to_exitcode(status) != 0:
                        self.fork_faults.append(f"the forked child failed ({status})")
                    return
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            stacks.seek(0)
            where = stacks.read().decode(errors="replace")[-4000:] or "(no stacks written)"
            self.fork_faults.append(
                f"the forked child hung for {FORK_DEADLINE:g}s in close(); its stacks:\n{where}"
            )

    def _do_rotate(self, step: Step) -> None:
        """A key-secret rotation's side-by-side phase (the two-step roll-out of the how-to):
        the worker's runtime keeps the new secret B as previous (step 1; the deliveries it
        had begun end first, as at a restart), then its deliveries alternate between it
        (secret A, B previous) and a runtime under B (A previous) on the same lock server,
        so copies of one job are gated under different secrets. ``seconds``: each record read
        answers that late, a slow link (issue 29 defects 2 and 3 race in that window)."""
        model = self.harness.model
        if model.rotating:
            return
        begun = set(worker_state.active_requests)
        model.reconfigure(step.seconds)
        deadline = time.monotonic() + ROTATE_TIMEOUT
        while begun & set(worker_state.active_requests) and time.monotonic() < deadline:
            time.sleep(0.02)
        model.rotating = True

    def _do_cut_db(self, step: Step) -> None:
        """Arm the cut: the next effect transaction to send statement ``at`` loses its
        session just before it (pg_terminate_backend from another connection). Nothing
        committed, or at COMMIT the outcome is unknown: delivered again, never FAILED
        (issue 29, defect 7). A later ``cut_db`` replaces an arming that has not fired."""
        if self.harness.cutter is not None:
            self.harness.cutter.arm(CUT_AT[step.at])

    def _to_second(self, step: Step) -> int | None:
        """Publish a new job (``hold``, mode ``checked``: it stops on a lease lost in a pause,
        not committing a stale effect) to the worker processes' queue; the index of the one
        that began it within BEGIN_TIMEOUT (None: no worker processes here, a publish refused,
        or none began it yet)."""
        second = self.harness.second
        if second is None:
            return None
        second.ensure()
        job = self._new_job(Step("publish", mode="checked", hold=step.hold))
        publish = Publish(job, "publish")
        self.publishes.append(publish)
        task = self.harness.model.tasks[self.options]
        try:
            task_id = publish.task_id = task.apply_async(self._args(job), queue=QUEUE).id
        except DuplicatePublish as exc:
            publish.refused = type(exc).__name__
            return None
        deadline = time.monotonic() + BEGIN_TIMEOUT
        while (holder := second.holder(task_id)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return holder

    def _do_pause_worker(self, step: Step) -> None:
        """A job on a worker process, then that process SIGSTOPped for ``seconds`` (past its
        lease and custody TTL) and resumed: the others' custody sweeps put its delivery back
        under a fresh tag and the other process runs it; on resume the paused one finds its
        lease lost and acks late, a stale ack that must not remove the put-back copy."""
        second = self.harness.second
        holder = self._to_second(step)
        if second is None or holder is None:
            return
        second.pause(holder)
        try:
            time.sleep(step.seconds)  # the fault's length, not a synchronisation
        finally:
            second.resume(holder)

    def _do_kill_worker(self, step: Step) -> None:
        """A job on a worker process, then every worker process SIGKILLed (whatever they
        hold: that job, an earlier pause's put-back copy) and started again: custody puts
        their deliveries back; nothing lost, nothing twice."""
        second = self.harness.second
        self._to_second(step)
        if second is not None:
            self.unlogged |= second.restart()
            # The instant every process was dead, not the step's start: a body that entered
            # while the processes were being killed (reading their events took a while) was
            # inside until then; the step's start would close it at the next kill, seconds on.
            self.kills.append(second.killed_at)

    def _fleet(self) -> BeatFleet:
        from tests.model.beat import BeatFleet

        if self.beat is None:
            self.beat = BeatFleet(self)
        return self.beat

    def _do_beat_tick(self, step: Step) -> None:
        self._fleet().beat_tick(step)

    def _do_beat_restart(self, step: Step) -> None:
        self._fleet().beat_restart(step)

    def _do_beat_handover(self, step: Step) -> None:
        self._fleet().beat_handover(step)

    def _do_flush(self, step: Step) -> None:
        if self.harness.locks is not None:
            self.harness.locks.client().flushall()

    # -- the end of a sequence ------------------------------------------------------

    def _results(self) -> Iterator[AsyncResult]:
        app = self.harness.model.app
        for p in self.publishes:
            for task_id in (p.task_id, p.tail_id):
                if task_id:
                    yield AsyncResult(task_id, app=app)

    def _idle(self) -> bool:
        client = self.harness.broker.client()
        busy = client.llen("celery") or client.hlen("unacked")
        return not busy and not worker_state.active_requests and not worker_state.reserved_requests

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Wait until every result is ready and the worker idle twice in a row, or until
        ``timeout`` passes with no result getting ready (at most DRAIN_LIMIT in all).

        The deadline moves with progress, not from the start: under ``lock_until="start"``
        every publish that meets a run queues behind it and runs after it, so a sequence of
        several 5 s holds needs their sum, more than any fixed drain (the seed
        ``wait-start-dedupe-chain-retry-pending``: four runs of 5 s, each ready in turn, were
        reported PENDING "for ever" by a 12 s drain). A job that never runs still fails."""
        if self.beat is not None:  # no slot falls during the drain
            self.beat.close()
        start = time.monotonic()
        deadline = start + timeout
        quiet, done = 0, -1
        while time.monotonic() < min(deadline, start + DRAIN_LIMIT) and quiet < 2:
            states = [r.ready() for r in self._results()]
            if sum(states) > done:
                done, deadline = sum(states), time.monotonic() + timeout
            quiet = quiet + 1 if all(states) and self._idle() else 0
            time.sleep(0.25)
        if self.harness.cutter is not None:  # an arming no transaction met ends here
            self.harness.cutter.disarm()

    def check(self) -> list[Violation]:
        """Every invariant of the issue, over what the callers saw and what the stores hold."""
        model = self.harness.model
        effects = model.effects(self.prefix)
        # Each cut delivers its job again: enough of them spend its redeliveries.
        faulted = any(s.kind in FAULTS for s in self.steps) or self.cuts_fired() >= REDELIVERY_LIMIT
        # Each kill ends whatever the worker processes run, a put-back copy too: a job caught
        # by as many kills as the crash cap is given up as a poison message, by design.
        poisoned = len(self.kills) >= CRASH_CAP
        found: list[Violation] = []
        outcome: dict[str, tuple[str, Any]] = {}
        for p in self.publishes:
            if p.task_id:
                r = AsyncResult(p.task_id, app=model.app)
                outcome[p.task_id] = (r.state, r.result)
        found += self._check_outcomes(outcome, effects, faulted, poisoned)
        found += self._check_effects(effects)
        found += self._check_jobs(outcome, effects)
        found += self._check_chains(outcome)
        found += self._check_decisions(effects)
        found += [Violation("fork-hang", fault) for fault in self.fork_faults]
        found += self._check_outbox(effects)
        found += self._check_newest(outcome)
        if self.beat is not None:
            found += self.beat.check(effects)
        if self.options.concurrency and "flush" not in {s.kind for s in self.steps}:
            found += self._check_slots()
        return found

    def _check_outcomes(
        self,
        outcome: dict[str, tuple[str, Any]],
        effects: list[dict[str, Any]],
        faulted: bool,
        poisoned: bool = False,
    ) -> list[Violation]:
        found = []
        keys = {e["job_key"] for e in effects}
        modes = {p.task_id: p.job.mode for p in self.publishes if p.task_id}
        heads = {p.task_id for p in self.publishes if p.tail_id}
        for task_id, (state, value) in outcome.items():
            if state == "SUCCESS" and _is_marker(value):
                # A marker returned as a result: the typed stops replaced them all.
                found.append(Violation("unexpected-marker", f"{task_id}: {value}"))
            elif state == "SUCCESS":
                if not isinstance(value, dict) or value.get("key") not in keys:
                    found.append(Violation("phantom-result", f"{task_id}: {value!r} has no effect"))
            elif state == "FAILURE" and type(value).__name__ in STOPS:
                # A recorded terminal state; whether its job took effect is _check_jobs's.
                if self._runs_every_publish() and type(value).__name__ == "DuplicateSkipped":
                    found.append(Violation("lost-run", f"{task_id} stopped: {value!r}"))
            elif state == "FAILURE":
                error = type(value).__name__
                allowed = set(CONFLICT_ERRORS) if self.options.on_conflict == "raise" else set()
                if modes[task_id] == "fail":
                    allowed.add("BodyFailed")
                if faulted:
                    allowed |= GIVEN_UP_ERRORS
                if poisoned:
                    allowed.add("PoisonMessage")
                if error not in allowed:
                    found.append(Violation("unexpected-failure", f"{task_id}: {error}: {value}"))
            elif state == "RETRY" and self._ended_after_retry(task_id):
                # Celery publishes a retry before it stores RETRY: under load the retried
                # copy may end (and store its state) first, and RETRY then overwrites it
                # (celery.app.task.Task.retry, then the tracer's handle_retry). The decision
                # log says the retried copy ended: not pending (the fuzz run of 2026-11-29).
                continue
            else:
                # A chain's head apart: its tail is published only after it.
                kind = "chain-pending" if task_id in heads else "pending-forever"
                found.append(Violation(kind, f"{task_id} still {state}"))
        return found

    def _ended_after_retry(self, task_id: str) -> bool:
        """Whether the decision log shows a delivery of `task_id` that ended after its
        body's retry ("released"): a final decision (its fate settled, stored or stopped)."""
        recorder = runtime_for(self.harness.model.app).executor.recorder
        if recorder is None or recorder.store is None:
            return False
        for rt in self.harness.model.runtimes():
            if rt.executor.recorder is not None:
                rt.executor.recorder.flush()
        events = [d.event for d in recorder.store.for_task(task_id)]
        if "released" not in events:
            return False
        return bool(set(events[events.index("released") + 1:]) & FINAL_EVENTS)

    def _check_outbox(self, effects: list[dict[str, Any]]) -> list[Violation]:
        """Publish on commit: a rolled-back job never takes effect, and every committed
        row of the sequence was sent (by its publisher or the relay)."""
        import sqlalchemy as sa

        from jobfence.tasks.effects import outbox

        found = []
        took_effect = {e["job_id"] for e in effects}
        for job in self.rolled_back:
            if job.job_id in took_effect:
                found.append(Violation("rolled-back-ran", f"{job.job_id} took effect"))
        ids = [p.task_id for p in self.publishes if p.kind == "on_commit" and p.task_id]
        if ids:
            with self.harness.model.engine.connect() as conn:
                unsent = conn.scalars(sa.select(outbox.c.task_id).where(
                    outbox.c.task_id.in_(ids), outbox.c.sent_at.is_(None)
                )).all()  # fmt: skip
            found += [Violation("outbox-unsent", task_id) for task_id in unsent]
        return found

    def _runs_every_publish(self) -> bool:
        """``lock_until="start"`` with wait/retry: a publish meeting a run queues behind it;
        supersede: it takes the key from the run, or is superseded by a newer one."""
        return self.options.lock_until == "start" and self.options.on_conflict in (
            "wait", "retry", "supersede"
        )  # fmt: skip

    def _check_newest(self, outcome: dict[str, tuple[str, Any]]) -> list[Violation]:
        """on_conflict="supersede": the newest publish of a job is never superseded (an older
        copy never stops a newer one). An outbox row the relay sends late ("died") counts
        from its step, when it was written: a newer publish's claim is never replaced by it
        (its task id tells when it was made). A sequence whose lock server lost its data
        (``flush``) is left out: the publish claims that order the publishes went with it,
        and the first copy to start after the loss stands for those published before it
        (docs/how-to/supersede.md; the fuzz run of 2026-11-29: a newest publish queued
        behind an older copy for want of a claim, then met its mark)."""
        if self.options.on_conflict != "supersede" or "flush" in {s.kind for s in self.steps}:
            return []
        newest: dict[str, Publish] = {}
        for p in self.publishes:
            if p.task_id:
                newest[p.job.job_id] = p
        # A late row meeting a publish whose task id tells no time (a chain's step, frozen by
        # Celery) is ordered by neither: documented (docs/how-to/publish-on-commit.md).
        for job_id in {p.job.job_id for p in self.publishes if p.kind == "on_commit"}:
            ids = [p.task_id for p in self.publishes if p.job.job_id == job_id and p.task_id]
            if any(published_at(i) is None for i in ids):
                newest.pop(job_id, None)
        found = []
        for p in newest.values():
            state, value = outcome[p.task_id or ""]
            if state == "FAILURE" and type(value).__name__ == "JobSuperseded":
                found.append(Violation("newest-superseded", f"{p.task_id}: {value!r}"))
        return found

    def _check_effects(self, effects: list[dict[str, Any]]) -> list[Violation]:
        field_name = "task_id" if self.options.run_per_publish else "job_id"
        counts = Counter(e[field_name] for e in effects)
        return [
            Violation("effect-twice", f"{field_name} {name} took effect {n} times")
            for name, n in counts.items()
            if n > 1
        ]

    def _check_jobs(
        self, outcome: dict[str, tuple[str, Any]], effects: list[dict[str, Any]]
    ) -> list[Violation]:
        """A job answered by a typed stop (or a marker) must have taken effect elsewhere, or
        failed visibly (a FAILURE that is not a stop)."""
        took_effect = {e["job_id"] for e in effects}
        by_job: dict[Job, list[tuple[str, Any]]] = defaultdict(list)
        for p in self.publishes:
            if p.task_id:
                by_job[p.job].append(outcome[p.task_id])
        found = []
        for job, seen in by_job.items():
            stops = [
                repr(v) for s, v in seen
                if (s == "SUCCESS" and _is_marker(v))
                or (s == "FAILURE" and type(v).__name__ in STOPS)
            ]  # fmt: skip
            failed = any(s == "FAILURE" and type(v).__name__ not in STOPS for s, v in seen)
            if stops and job.job_id not in took_effect and not failed:
                found.append(Violation("lost-job", f"{job.job_id} answered {stops} only"))
        return found

    def _check_chains(self, outcome: dict[str, tuple[str, Any]]) -> list[Violation]:
        found = []
        for value in self.harness.model.tail_values(self.prefix):
            if _is_marker(value):
                found.append(Violation("marker-in-chain", f"a chain step received {value}"))
        app = self.harness.model.app
        for p in self.publishes:
            # A head stopped (a typed stop, or any FAILURE) stops its chain: a documented end.
            if p.tail_id and p.task_id:
                head_state, head_value = outcome[p.task_id]
                real = head_state == "SUCCESS" and not _is_marker(head_value)
                tail = AsyncResult(p.tail_id, app=app)
                if real and tail.state != "SUCCESS":
                    found.append(Violation("chain-stalled", f"{p.tail_id} {tail.state}"))
        return found

    def _check_decisions(self, effects: list[dict[str, Any]]) -> list[Violation]:
        """The decision log agrees with what happened (`jobfence locks why` reads it): a
        delivery whose body took effect says it ran; a "done" (the DONE record stored) is
        true where the lock server keeps records (lock_until="finish", no unique_for, no
        flush): the job's record is there, DONE."""
        runtime = runtime_for(self.harness.model.app)
        recorder = runtime.executor.recorder
        if recorder is None or recorder.store is None:
            return []
        # A rotation's second runtime records into the same store (one lock backend).
        for rt in self.harness.model.runtimes():
            if rt.executor.recorder is not None:
                rt.executor.recorder.flush()
        ran = {e["task_id"]: e["job_key"] for e in effects}
        # The decision log lives on the lock server: a `flush` (all its data lost) takes the
        # decisions stored before it too (seed `decision-log-lost-with-the-lock-servers-data`).
        flushed = "flush" in {s.kind for s in self.steps}
        kept = (
            self.options.lock_until == "finish" and self.options.unique_for is None and not flushed
        )
        found, store = [], recorder.store
        for task_id in dict.fromkeys(p.task_id for p in self.publishes if p.task_id):
            decisions = store.for_task(task_id)
            events = {d.event for d in decisions}
            key = ran.get(task_id)
            if (
                key is not None
                and not flushed
                and not events & RAN_EVENTS
                and not self._log_full(store, key)
                and task_id not in self.unlogged
            ):
                found.append(Violation(
                    "decision-untrue", f"{task_id} took effect; the log says only {sorted(events)}"
                ))  # fmt: skip
            for d in decisions:
                if d.event != "done" or not kept:
                    continue
                record = runtime.backend.job_record(d.key)
                if record is None or record.state != "DONE":
                    state = record.state if record is not None else "no record"
                    found.append(Violation(
                        "decision-untrue", f"{task_id} logged 'done' (DONE record stored); the "
                        f"lock server has {state}",
                    ))  # fmt: skip
        return found

    def _log_full(self, store: DecisionLog, key: str) -> bool:
        """The key's log holds its bound of decisions: older ones may have been pushed out."""
        bound = store.bounds.per_key
        return len(store.for_key(key, bound)) >= bound

    def _lapsed_holders(self) -> int:
        """How many of this sequence's deliveries lost their lease mid-body: their decisions
        say so, or (a body killed before it noticed, its decision never made) their keeper
        told the ledger it found the slot gone (the fuzz run of 2026-11-29: a holder's slot
        lapsed in two lock-server blips, the next job took it, and a kill ended the holder
        before its body looked: `slot-overlap` with no decision to count it)."""
        recorder = runtime_for(self.harness.model.app).executor.recorder
        if recorder is None or recorder.store is None:
            return 0
        for rt in self.harness.model.runtimes():
            if rt.executor.recorder is not None:
                rt.executor.recorder.flush()
        lapsed, decided = 0, set()
        for task_id in dict.fromkeys(p.task_id for p in self.publishes if p.task_id):
            for d in recorder.store.for_task(task_id):
                if d.event in LAPSED_EVENTS and d.reason != "replaced" and d.fence is not None:
                    lapsed += 1
                    decided.add(task_id)
        told = self.harness.model.lapsed_holders(self.group)
        return lapsed + sum(1 for task_id in told if task_id not in decided)

    def _check_slots(self) -> list[Violation]:
        events = self.harness.model.slot_events(self.group)
        # A body killed inside its slot never records its exit: it left at the kill (its
        # slot then lapses at its TTL; seed `a-killed-slot-holder-never-exits`).
        by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for e in events:
            by_task[e["task_id"]].append(e)
        for mine in by_task.values():  # the put-back copy runs under the same task id
            mine.sort(key=lambda e: (e["t"], e["kind"] == "enter"))
            open_at: float | None = None
            for e in [*mine, None]:
                if open_at is not None and (e is None or e["kind"] == "enter"):
                    killed = [k for k in self.kills if k >= open_at]
                    if killed:  # entered, never exited: it left at the kill
                        events.append({"kind": "exit", "task_id": "", "t": killed[0]})
                if e is not None:
                    open_at = e["t"] if e["kind"] == "enter" else None
        # At one instant an exit counts before an enter: intervals that only touch never overlap.
        events.sort(key=lambda e: (e["t"], e["kind"] == "enter"))
        inside, most = 0, 0
        for event in events:
            inside += 1 if event["kind"] == "enter" else -1
            most = max(most, inside)
        limit = self.options.concurrency
        if any(s.kind == "rotate" for s in self.steps):
            # A group's semaphore key is an HMAC under the current secret, not looked up
            # under the previous one: during a rotation a group may admit up to twice its
            # limit (docs/how-to/rotate-key-secret.md), never more.
            limit *= 2
        # A holder paused past its slot's TTL loses the slot (another job takes it) while its
        # body, frozen, still counts as inside here until it resumes and finds its lease
        # lost: one more per pause, as a frozen lock holder beside its successor (the fence,
        # not the slot, keeps their writes apart; seed `a-paused-slot-holder-beside-two`).
        # So is a holder whose lease lapsed mid-body with no pause step: its keeper starved
        # past the 1.5 s TTL on a loaded machine (a long fuzz run beside a suite: two leases
        # "lost" at one instant after a 2.6 s silence). Its decisions say so (the lease lost
        # before its commit, or superseded by a newer holder), and its writes were fenced. A
        # paused holder lapses too: counted once.
        pauses = sum(1 for s in self.steps if s.kind == "pause_worker")
        limit += max(pauses, self._lapsed_holders())
        if most > limit:
            return [Violation("slot-overlap", f"{most} inside a limit of {limit}")]
        return []


#: Decisions that settle a delivery's fate (its record stored, or a typed stop).
FINAL_EVENTS = frozenset({"done", "failed", "superseded", "stale", "replayed", "given_up",
                          "poisoned", "throttled", "rate_skipped"})  # fmt: skip
#: Decisions of a delivery whose lease lapsed mid-body (not one replaced before it started).
LAPSED_EVENTS = frozenset({"lease_lost", "commit_refused", "superseded", "stale"})


def _is_marker(value: Any) -> bool:
    """A jobfence marker dict (``{"jobfence": ...}``), never a job's own result."""
    return isinstance(value, dict) and "jobfence" in value
