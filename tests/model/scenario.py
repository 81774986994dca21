"""One model sequence: steps run against the live worker, a bounded drain, then the invariants.

A sequence is plain data (an option combination and a list of steps, see :class:`Step`), so
the hypothesis machine and the seed database (``seeds.json``) replay it through the same
code. :meth:`Scenario.check` returns every violation found, each named by its class.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from celery import chain
from celery.result import AsyncResult
from celery.worker import state as worker_state

from jobfence.tasks import DuplicatePublish, runtime_for
from tests.model.app import ModelApp, Options
from tests.servers import RedisServer

__all__ = [
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
#: Steps that break the lease or the lock server's data (they allow a given-up job).
FAULTS = frozenset({"lose_leases", "blip", "flush"})
#: Failures a caller may see without a fault or a failing body: ``on_conflict="raise"``.
CONFLICT_ERRORS = frozenset({"DuplicateJob", "DuplicatePublish"})
#: Failures allowed after a fault: given up after the redelivery limit or the crash cap.
GIVEN_UP_ERRORS = frozenset({"RedeliveryLimitReached", "PoisonMessage"})
#: Typed stops (``JobSkipped`` and its subclasses): a delivery with no result of its own, a
#: recorded FAILURE its caller can tell apart from a result; the job took effect elsewhere.
STOPS = frozenset(
    {"JobSkipped", "DuplicateSkipped", "JobSuperseded", "JobDropped", "RateLimitSkipped"}
)


@dataclass(frozen=True)
class Step:
    """One action: ``publish`` / ``duplicate`` / ``redeliver`` / ``chain`` take ``job`` (an
    index into the jobs published so far, modulo their number; ``publish`` makes a new one
    with ``mode`` and ``hold``); ``countdown`` delays a publish; ``blip`` pauses the lock
    server for ``seconds``; ``sleep`` lets time pass; ``lose_leases`` and ``flush`` take none."""

    kind: str
    job: int = 0
    mode: str = "ok"
    hold: float = 0.02
    countdown: float | None = None
    seconds: float = 0.0

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
    """The live worker's app and, on the Redis backend, the lock server the faults hit."""

    model: ModelApp
    backend: str
    broker: RedisServer
    locks: RedisServer | None = None


@dataclass
class Scenario:
    """Runs the steps of one sequence on a fresh namespace of job ids and one option set."""

    harness: Harness
    options: Options
    prefix: str = field(default_factory=lambda: f"m{uuid.uuid4().hex[:10]}-")
    steps: list[Step] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    publishes: list[Publish] = field(default_factory=list)

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
        earlier = [p for p in self.publishes if p.job == job and p.task_id and not p.tail_id]
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
        """Wait until every result is ready and the worker idle twice in a row, or ``timeout``."""
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline and quiet < 2:
            ready = all(r.ready() for r in self._results())
            quiet = quiet + 1 if ready and self._idle() else 0
            time.sleep(0.25)

    def check(self) -> list[Violation]:
        """Every invariant of the issue, over what the callers saw and what the stores hold."""
        model = self.harness.model
        effects = model.effects(self.prefix)
        faulted = any(s.kind in FAULTS for s in self.steps)
        found: list[Violation] = []
        outcome: dict[str, tuple[str, Any]] = {}
        for p in self.publishes:
            if p.task_id:
                r = AsyncResult(p.task_id, app=model.app)
                outcome[p.task_id] = (r.state, r.result)
        found += self._check_outcomes(outcome, effects, faulted)
        found += self._check_effects(effects)
        found += self._check_jobs(outcome, effects)
        found += self._check_chains(outcome)
        if self.options.concurrency and "flush" not in {s.kind for s in self.steps}:
            found += self._check_slots()
        return found

    def _check_outcomes(
        self, outcome: dict[str, tuple[str, Any]], effects: list[dict[str, Any]], faulted: bool
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
                if error not in allowed:
                    found.append(Violation("unexpected-failure", f"{task_id}: {error}: {value}"))
            else:
                # A chain's head apart: its tail is published only after it.
                kind = "chain-pending" if task_id in heads else "pending-forever"
                found.append(Violation(kind, f"{task_id} still {state}"))
        return found

    def _runs_every_publish(self) -> bool:
        """``lock_until="start"`` with wait/retry: a publish meeting a run queues behind it."""
        return self.options.lock_until == "start" and self.options.on_conflict in ("wait", "retry")

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

    def _check_slots(self) -> list[Violation]:
        events = self.harness.model.slot_events(self.group)
        # At one instant an exit counts before an enter: intervals that only touch never overlap.
        events.sort(key=lambda e: (e["t"], e["kind"] == "enter"))
        inside, most = 0, 0
        for event in events:
            inside += 1 if event["kind"] == "enter" else -1
            most = max(most, inside)
        if most > self.options.concurrency:
            return [
                Violation("slot-overlap", f"{most} inside a limit of {self.options.concurrency}")
            ]
        return []


def _is_marker(value: Any) -> bool:
    """A jobfence marker dict (``{"jobfence": ...}``), never a job's own result."""
    return isinstance(value, dict) and "jobfence" in value
