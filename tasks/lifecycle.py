"""The job lifecycle as I/O-free flows: look up DONE, acquire, gate, run, commit, or say why not.

A flow yields ops (locks/ops.py for the store's round trips; `Keep`, `Drop`, `RunBody`,
`Note` and `AfterOuterCommit` below for what the shell does) and returns an `Outcome`, or
raises what the caller must see. It never touches a socket, a clock, a thread or the body:
`Executor` (tasks/executor.py) runs it with `run_sync`, and a test runs it by hand with
scripted replies (tests/tasks/test_lifecycle.py), every branch of the safety argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from jobfence.locks.backend import Busy, JobRecord, RateGrant, default_meta
from jobfence.locks.errors import (
    AcquireTimeout,
    BackendUnavailable,
    CommitOutcomeUnknown,
    LeaseLost,
    StaleFence,
)
from jobfence.locks.flows import Backoff, slot_flow
from jobfence.locks.lease import Lease
from jobfence.locks.ops import (
    Begin,
    Commit,
    CountDelivery,
    Inspect,
    Now,
    Op,
    ReadRecord,
    Release,
    Sleep,
    SwapPublish,
    TakeRate,
    WaitRelease,
)
from jobfence.locks.outage import OUTAGE
from jobfence.locks.slots import SlotLease
from jobfence.tasks.context import JobContext
from jobfence.tasks.errors import DuplicateJob, IdempotencyConflict, PoisonMessage, TaskError
from jobfence.tasks.keys import canonical_json, result_json
from jobfence.tasks.metrics import Metrics

# The executor's logger: operators' filters and the tests' log checks name it.
log = logging.getLogger("jobfence.tasks.executor")

ConflictPolicy = Literal["skip", "wait", "retry", "raise"]
CONFLICT_POLICIES: tuple[str, ...] = ("skip", "wait", "retry", "raise")
LeaseLostPolicy = Literal["redeliver", "drop"]
LEASE_LOST_POLICIES: tuple[str, ...] = ("redeliver", "drop")
LockUntil = Literal["finish", "start"]
LOCK_UNTIL: tuple[str, ...] = ("finish", "start")
#: Prefix of a publish claim whose job has started (or finished): it can no longer be replaced.
STARTED = "!"
Status = Literal[
    "ran", "replayed", "duplicate", "superseded", "defer", "retry", "redeliver", "dropped",
    "requeue",
    "rate_limited",
    "rate_skipped",
]
RateLimitedPolicy = Literal["retry", "skip", "wait"]
RATE_LIMITED_POLICIES: tuple[str, ...] = ("retry", "skip", "wait")
#: How far ahead a delivery may reserve its turn under a global rate limit; a job whose turn
#: is further away comes back later and asks again (nothing reserved meanwhile).
RATE_HORIZON = 3600.0
#: "retry": a wait up to this is slept out in the worker rather than sent through the
#: broker (a copy for a near turn would queue behind the backlog and start late) ...
RATE_INLINE = 1.0
#: ... and so is what is left when a copy arrives before its reserved turn.
RATE_ARRIVAL_SLACK = 1.0
#: The starts limiter (`<key>:starts`): a start may wait this long for its place; further
#: behind, the job takes a new turn instead.
RATE_START_SLACK = 1.0
START_SUFFIX = ":starts"

Observer = Callable[[str, "JobSpec", int | None], None]  # event, job, fence

DUPLICATE = {"jobfence": "duplicate"}
SUPERSEDED = {"jobfence": "superseded"}
DROPPED = {"jobfence": "dropped"}
RATE_SKIPPED = {"jobfence": "rate_limited"}

#: Commit attempts (at least) when the reply to a commit is lost; more while the lease lasts.
COMMIT_ATTEMPTS = 3
#: A job that found no concurrency slot in time comes back after 1-2 times this (seconds).
SLOT_REQUEUE_DELAY = 1.0


class RedeliveryLimitReached(TaskError):
    """A job's fate stayed unknown through every redelivery allowed; it is given up, logged."""


@dataclass(frozen=True)
class Redelivery:
    """How a job whose fate is unknown comes back: doubling delays with jitter, and a bound.

    `limit` redeliveries at most (then a FAILED record where it can be written, and an
    error); delay n is uniform in [d/2, d] with d = min(cap, base * 2**n).
    """

    limit: int = 20
    base: float = 1.0
    cap: float = 60.0
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def __post_init__(self) -> None:
        if self.limit < 0 or self.base <= 0 or self.cap < self.base:
            raise ValueError(
                f"redelivery needs limit >= 0 and 0 < base <= cap, got limit={self.limit} "
                f"base={self.base} cap={self.cap}"
            )

    def delay(self, attempt: int) -> float:
        step = min(self.cap, self.base * (2 ** min(attempt, 32)))
        return float(step / 2 + self.rng.uniform(0, step / 2))


@dataclass(frozen=True)
class RateSpec:
    """A job's global rate limit (locks/ratelimit.py): checked after the job's lease is
    granted, so a replay or a duplicate never spends a turn."""

    key: str  # the limiter: task name, or task name and a digest of the rate_key arguments
    label: str  # for metrics: the task name, never arguments
    interval: float
    burst: int = 1
    on_limited: RateLimitedPolicy = "retry"
    wait_timeout: float = 10.0  # "wait": the longest the worker sleeps for a turn
    slot: float | None = None  # server time of a turn an earlier delivery reserved


@dataclass(frozen=True)
class JobSpec:
    """One delivery of a job, as the executor needs it."""

    name: str
    key: str
    fingerprint: str
    ttl: float
    result_ttl: float
    task_id: str = ""
    on_conflict: ConflictPolicy = "skip"
    wait_timeout: float = 10.0
    on_lease_lost: LeaseLostPolicy = "redeliver"
    redeliveries: int = 0  # how often this job already came back with its fate unknown
    # This delivery may follow one that died mid-body (broker redelivery, or our deferred
    # copy of one); such grants are counted per run, and past `max_crashed` the job is
    # recorded FAILED instead of run again (0: no cap).
    suspect: bool = False
    max_crashed: int = 0
    # Lock lifetimes (README "Lock lifetimes and duplicate publishes"). `lock_until="start"`
    # drops the publish claim when the body starts (past its rate turn and slot); `unique_for`
    # keeps it that many seconds after the run finished. With either, each publish is a run of
    # its own: its DONE record answers its own redeliveries, not a later publish of the key.
    lock_until: LockUntil = "finish"
    unique_for: float = 0.0
    claim_ttl: float = 60.0  # the publish claim's TTL while the job runs
    # on_duplicate_publish="replace": a publish claim held by another copy proves this one
    # was replaced before it started, so it is skipped as superseded.
    supersede: bool = False
    publish_claim: bool = False  # dedupe_on_publish: the key has a publish claim to update
    # Delivered through a broker: a wait/retry conflict can queue behind the live holder (this
    # message published again) under any lock_until, instead of spending Celery's retries or
    # giving up at wait_timeout while the job it waits for still runs.
    queues: bool = False

    # At most `concurrency` jobs of the group `concurrency_key` run at once (0: no limit);
    # a job waits up to `wait_timeout` for a slot, then comes back later ("requeue").
    concurrency: int = 0
    concurrency_key: str = ""
    rate: RateSpec | None = None
    # (key, fingerprint) of the job under each earlier key secret (a rotation): looked up
    # for its DONE record or a live holder, never granted.
    previous: tuple[tuple[str, str], ...] = ()

    @property
    def per_run(self) -> bool:
        """Each publish runs (not only the first): its record answers its own deliveries."""
        return self.lock_until == "start" or self.unique_for > 0

    @property
    def record_fingerprint(self) -> str:
        """The fingerprint stored with the record: per run, it names the run (task id)."""
        return f"{self.fingerprint}#{self.task_id}" if self.per_run else self.fingerprint

    @property
    def claim_at_body(self) -> bool:
        """The claim is dropped when the body really starts, not at the grant (lock_until)."""
        return self.lock_until == "start"

    @property
    def claims(self) -> bool:
        """Whether this delivery reads and updates the key's publish claim at start."""
        return bool(self.task_id) and (
            self.supersede
            or self.unique_for > 0
            or (self.lock_until == "start" and self.publish_claim)
        )


@dataclass(frozen=True)
class Outcome:
    """What happened to one delivery. `countdown` is set for `defer`, `retry`, `redeliver`
    and `requeue` (no concurrency slot came free in time, or under lock_until="start" another
    run of the key holds it: publish again, nothing counted).

    `redeliver`: the job's fate is unknown (lock server unavailable, lease lost without
    proof of a newer holder, commit outcome unknown); deliver it again with the same key,
    never drop it. `reason` says why, for logs.
    """

    status: Status
    value: Any = None
    fence: int | None = None
    countdown: float = 0.0
    reason: str = ""
    slot: float | None = None  # rate_limited: the server time of the turn reserved, if any
    holder: str = ""  # duplicate: the task id of the copy that has the job, where known


# -- what the shell does for a flow (not store round trips) --------------------------------


@dataclass(slots=True)
class Keep:
    """Have the keeper renew `lease` until dropped; a loss of it marks `tie` lost too (a
    concurrency slot: past it the job may be one too many, so it stops as if its lease went)."""

    lease: Lease
    tie: Lease | None = None


@dataclass(slots=True)
class Drop:
    """Stop renewing `lease` (it is released, committed or given up)."""

    lease: Lease


@dataclass(slots=True)
class RunBody:
    """Run the job's body with `ctx` as the current job; the reply is its value, or what it
    raised is thrown into the flow."""

    ctx: JobContext


@dataclass(slots=True)
class Note:
    """Tell the observers (a journal) of `event`; an observer never changes the job's fate."""

    event: str
    fence: int | None
    holder: str = ""  # the other task's id where the flow knows it (a copy, a newer publish)
    newer: int | None = None  # stale: the fence the resource had accepted already
    reason: str = ""  # a fixed phrase (the conflict policy, why a redelivery): no argument


@dataclass(slots=True)
class AfterOuterCommit:
    """The body's effect committed into callers' transactions (`ctx.outer`): once every one
    commits, store the DONE record (`record_done_flow`), best effort, from their hook."""

    ctx: JobContext
    result: str


ShellOp = Keep | Drop | RunBody | Note | AfterOuterCommit
JobOp = Op | ShellOp
T = TypeVar("T")
#: A job flow: yields store and shell ops, is sent each reply, returns its value.
JobFlow = Generator[JobOp, Any, T]


def job_flow(
    spec: JobSpec,
    *,
    backoff: Backoff,
    redelivery: Redelivery,
    metrics: Metrics,
    passthrough: tuple[type[BaseException], ...] = (),
) -> JobFlow[Outcome]:
    """One delivery of `spec`, start to end: the body run once under the job's lease, its
    record committed, or why not. Exceptions in `passthrough` release without a record."""
    return Job(spec, backoff=backoff, redelivery=redelivery, metrics=metrics).run(passthrough)


class Job:
    """The decisions for one delivery of a job, as flows (generator methods). Metrics are
    plain calls on the shell's `Metrics` (in-process counters); everything else is an op.

    Round trips on Redis for a job that runs: one `Begin` (DONE check and grant), one
    `Commit` (DONE record and release), plus the keeper's batched extensions.
    """

    def __init__(
        self,
        spec: JobSpec,
        *,
        backoff: Backoff,
        redelivery: Redelivery,
        metrics: Metrics,
        noting: bool = True,
    ) -> None:
        self.spec = spec
        self.backoff = backoff
        self.redelivery = redelivery
        self.metrics = metrics
        # False: nobody listens, so a job that runs sends no Note for "started" and "done"
        # (two ops per job for nothing); the rarer events are always sent.
        self.noting = noting

    def run(self, passthrough: tuple[type[BaseException], ...] = ()) -> JobFlow[Outcome]:
        """Begin, claim, cap, keep, rate gate, slot, body, commit."""
        spec = self.spec
        got = yield from self.begin()
        if isinstance(got, Outcome):
            return got
        lease = got
        if spec.claims and not spec.claim_at_body:
            skipped = yield from self.claim_at_start(lease)
            if skipped is not None:
                return skipped
        if spec.suspect and spec.max_crashed:
            yield from self.cap_crashes(lease)
        yield Keep(lease)
        if spec.rate is not None:
            held = yield from self.rate_gate(spec.rate, lease)
            if held is not None:
                return held
        if not spec.concurrency:
            return (yield from self.run_held(lease, passthrough))
        slot = yield from self.take_slot(lease)
        if isinstance(slot, Outcome):
            return slot
        try:
            out = yield from self.run_held(lease, passthrough, slot)
        except GeneratorExit:
            raise  # closed unrun: nothing to send
        except BaseException:
            yield from self.release_slot(slot)
            raise
        yield from self.release_slot(slot)
        return out

    # -- begin: replay, conflict, wait, or a grant ---------------------------------------
    def begin(self) -> JobFlow[Lease | Outcome]:
        """Acquire the job's lease, or say why not (replay, duplicate, defer, retry, redeliver)."""
        spec = self.spec
        started: float = yield Now()
        deadline = started + spec.wait_timeout
        meta = default_meta(task_id=spec.task_id, task_name=spec.name)
        fingerprint = spec.record_fingerprint
        attempt = 0
        try:
            while True:
                got = yield Begin(spec.key, spec.ttl, meta, record=True, fingerprint=fingerprint)
                if isinstance(got, JobRecord) and spec.per_run and got.fingerprint != fingerprint:
                    # An earlier run's record: this publish is a run of its own (the lock still
                    # keeps it from running beside another).
                    got = yield Begin(spec.key, spec.ttl, meta, False, fingerprint)
                if isinstance(got, Lease) and spec.previous:
                    got = yield from self.under_previous_secret(got)
                if isinstance(got, Lease):
                    self.metrics.task(spec.name).acquire_wait.observe((yield Now()) - started)
                    return got
                if isinstance(got, JobRecord):
                    if spec.supersede and spec.claims and got.fingerprint != fingerprint:
                        # Replaced, and the replacement (other arguments) already finished.
                        kept = yield from self.swap_claim()
                        if kept is not None and kept != STARTED + spec.task_id:
                            return (yield from self.superseded_copy(None, kept))
                    return (yield from self.replay(got))
                busy: Busy = got
                if (
                    not spec.per_run  # per run, another copy's arguments are another run's
                    and busy.fingerprint
                    and spec.fingerprint
                    and busy.fingerprint != spec.fingerprint
                ):
                    raise IdempotencyConflict(
                        "idempotency key in use by a running job with different arguments; use "
                        "a new key or the original arguments",
                        key=spec.key,
                    )
                if spec.task_id and busy.task_id == spec.task_id:
                    # Our own earlier delivery holds it (redelivered or crashed): come back when
                    # its lease ends. Dropping this copy could lose the job if that holder died.
                    yield Note("defer", None, busy.task_id or "")
                    return Outcome("defer", countdown=self.after(busy, attempt))
                self.metrics.conflicts.labels(spec.name, spec.on_conflict).inc()
                yield Note("conflict", None, busy.task_id or "", reason=spec.on_conflict)
                if spec.on_conflict == "skip":
                    return Outcome("duplicate", DUPLICATE, holder=busy.task_id or "")
                if spec.on_conflict == "raise":
                    raise DuplicateJob("job is running elsewhere", key=spec.key)
                behind = spec.lock_until == "start" or spec.queues
                if spec.on_conflict == "retry":
                    if behind:
                        return (yield from self.behind(busy, attempt))
                    return Outcome("retry", countdown=self.after(busy, attempt))
                left = deadline - (yield Now())
                if left <= 0:
                    if behind:
                        return (yield from self.behind(busy, attempt))
                    self.metrics.timeouts.labels(spec.name).inc()
                    raise AcquireTimeout(
                        f"job still running after {spec.wait_timeout:g}s", key=spec.key
                    )
                pause = min(left, busy.ttl_left + 0.001, max(self.backoff.delay(attempt), 0.001))
                yield WaitRelease(spec.key, pause)
                attempt += 1
        except BackendUnavailable as exc:
            OUTAGE.warning(log, "lock server unavailable before job %s ran: %s", spec.key,
                           type(exc).__name__)  # fmt: skip
            return (yield from self.redeliver("lock server unavailable before the body ran", None))

    def after(self, busy: Busy, attempt: int) -> float:
        """When to come back: the holder's lease left, plus a jittered step."""
        return min(busy.ttl_left, 3600.0) + self.backoff.delay(attempt)

    def behind(self, busy: Busy, attempt: int) -> JobFlow[Outcome]:
        """Another delivery holds the key (lock_until="start": another run of it; "finish"
        through a broker: a copy of this job). This one queues behind it, as long as that
        holder lives (its lease renewed), spending neither Celery's retries nor the
        redelivery bound; it then replays the holder's DONE record ("finish") or runs. A
        holder that dies frees the key at its lease's expiry."""
        yield Note("queued", None, busy.task_id or "")
        return Outcome(
            "requeue",
            countdown=self.after(busy, attempt),
            reason="another run of the key holds it",
        )

    def under_previous_secret(self, lease: Lease) -> JobFlow[Lease | Busy | JobRecord]:
        """Our grant, unless the job's key under an earlier secret has its DONE record or a
        live holder (then that, our grant released). Looked at after the grant, so a worker
        on either secret of a rotation sees the other's hold: neither can miss both."""
        spec = self.spec
        for key, fingerprint in spec.previous:
            record: JobRecord | None = yield ReadRecord(key)
            run = f"{fingerprint}#{spec.task_id}" if spec.per_run else fingerprint
            if record is not None and record.state == "DONE":
                if record.fingerprint == run:  # the same job: answer with our fingerprint
                    yield Release(lease)
                    return dataclasses.replace(record, fingerprint=spec.record_fingerprint)
                if not spec.per_run:  # other arguments under the key: a conflict
                    yield Release(lease)
                    return record
            held = yield Inspect(key)
            if held is not None:
                yield Release(lease)
                return Busy(held.ttl_left, held.task_id)
        return lease

    def replay(self, record: JobRecord) -> JobFlow[Outcome]:
        """The job's record answers: its result, or a conflict (other arguments)."""
        spec = self.spec
        if record.fingerprint != spec.record_fingerprint:
            raise IdempotencyConflict(
                "idempotency key reused with different arguments; use a new key or the "
                "original arguments",
                key=spec.key,
                fence=record.fence,
            )
        self.metrics.replays.labels(spec.name).inc()
        yield Note("replayed", record.fence)
        return Outcome(
            "replayed", json.loads(record.result) if record.result else None, record.fence
        )

    # -- the publish claim at start ----------------------------------------------------
    def claim_at_start(self, lease: Lease) -> JobFlow[Outcome | None]:
        """Mark the publish claim started (or drop it, lock_until="start"), holding the
        lease; None to run. A claim another copy holds proves this copy was replaced
        (supersede), or, marked started, that the key ran within `unique_for` (throttled)."""
        spec = self.spec
        try:
            kept = yield from self.swap_claim()
        except BackendUnavailable as exc:
            OUTAGE.warning(log, "lock server unavailable at job %s's start: %s", spec.key,
                           type(exc).__name__)  # fmt: skip
            yield from self.release_quietly(lease)
            return (yield from self.redeliver("lock server unavailable before the body ran", None))
        if kept is None or kept == STARTED + spec.task_id:
            return None
        if spec.supersede:
            return (yield from self.superseded_copy(lease, kept))
        if spec.unique_for and kept.startswith(STARTED):
            self.metrics.conflicts.labels(spec.name, "unique_for").inc()
            yield Note("throttled", lease.fence, kept.removeprefix(STARTED))
            yield from self.release_quietly(lease)
            return Outcome("duplicate", DUPLICATE, lease.fence, holder=kept.removeprefix(STARTED))
        return None

    def swap_claim(self) -> JobFlow[str | None]:
        """Our claim marked started (dropped under lock_until="start"); else who holds it."""
        spec = self.spec
        new = None if spec.lock_until == "start" else STARTED + spec.task_id
        kept: str | None = yield SwapPublish(spec.key, spec.task_id, new, spec.claim_ttl)
        return kept

    def superseded_copy(self, lease: Lease | None, holder: str) -> JobFlow[Outcome]:
        """A newer publish replaced this copy before it started: skip, acked, never run."""
        spec = self.spec
        log.info("job %s task %s superseded by task %s, published to replace it",
                 spec.key, spec.task_id, holder.removeprefix(STARTED))  # fmt: skip
        self.metrics.executions.labels(spec.name, "superseded").inc()
        fence = None if lease is None else lease.fence
        yield Note("superseded", fence, holder.removeprefix(STARTED), reason="replaced")
        if lease is not None:
            yield from self.release_quietly(lease)
        return Outcome("superseded", SUPERSEDED, fence)

    def throttle(self) -> JobFlow[None]:
        """unique_for: the claim, marked started, lasts that long after the run finished."""
        spec = self.spec
        mine = STARTED + spec.task_id
        try:
            yield SwapPublish(spec.key, mine, mine, spec.unique_for)
        except BackendUnavailable as exc:  # the job is done; only the throttle is lost
            OUTAGE.warning(log, "job %s: unique_for window not set: %s", spec.key,
                           type(exc).__name__)  # fmt: skip

    # -- the crash cap -----------------------------------------------------------------
    def cap_crashes(self, lease: Lease) -> JobFlow[None]:
        """Count a grant that follows a delivery which may have died; past the cap, give up.

        A message that kills its worker every time would otherwise loop for ever under
        acks_late + reject_on_worker_lost. Giving up records FAILED, logs one dead-letter
        line (task name and key, never the arguments) and raises. The count is kept: a FAILED
        record does not stop a new grant, so another copy of the same message (the broker's
        and the worker's requeue can both exist) must find the job given up too. A fresh
        submission still runs once; only crash-suspect deliveries are refused.

        The count is per run: the key and a digest of the task id (every copy of one message
        shares it; a new publish does not), so runs that share a key under per-run lifetimes
        never add up, and a run's DONE ends its count (the next run starts at zero).
        """
        spec = self.spec
        # A digest: a task id may be long or hold characters a key may not, and stays opaque.
        run = hashlib.sha256(spec.task_id.encode()).hexdigest()[:16] if spec.task_id else ""
        counter = f"{spec.key}#run:{run}" if run else spec.key
        count: int | None
        try:
            count = yield CountDelivery(counter, spec.result_ttl)
        except BackendUnavailable:
            count = None  # best effort: running the body again is what no cap would do
        if count is None or count <= spec.max_crashed:
            return
        crashed = min(count - 1, spec.max_crashed)
        message = (
            f"gave up after {crashed} deliveries that ended without a record (their worker "
            f"was lost mid-body); limit JOBFENCE_MAX_CRASHED_DELIVERIES={spec.max_crashed}"
        )
        failed = canonical_json({"error": PoisonMessage.__name__, "message": message})
        yield from self.finish(lease, "FAILED", failed)
        self.metrics.executions.labels(spec.name, "poisoned").inc()
        yield Note("poisoned", lease.fence)
        if count == spec.max_crashed + 1:
            log.error(
                "dead-letter: task %s key %s recorded FAILED: %s", spec.name, spec.key, message
            )
        else:
            log.warning(
                "task %s key %s: another copy of a dead-lettered job refused (FAILED kept)",
                spec.name,
                spec.key,
            )
        raise PoisonMessage(message, key=spec.key, fence=lease.fence)

    # -- the global rate limit ---------------------------------------------------------
    def rate_gate(self, rate: RateSpec, lease: Lease) -> JobFlow[Outcome | None]:
        """None: the job may start now (after a wait sat out here). Else the lease is
        released and the outcome says: come back at the reserved turn, or skipped.

        After the lease, not before: a delivery that replays a DONE record or meets a
        duplicate spends no turn, and only the one delivery that holds the job's lease can.
        """
        try:
            return (yield from self.rate_turn(rate, lease))
        except BackendUnavailable as exc:
            yield from self.release_quietly(lease)
            OUTAGE.warning(log, "lock server unavailable before job %s ran: %s", self.spec.key,
                           type(exc).__name__)  # fmt: skip
            return (yield from self.redeliver("lock server unavailable before the body ran", None))

    def rate_turn(self, rate: RateSpec, lease: Lease) -> JobFlow[Outcome | None]:
        """Two limiters of the same rate: `rate.key` hands out turns (a delivery whose turn is
        far comes back for it through the broker), `<key>:starts` admits the starts
        themselves, so a broker or pool that delivers copies late never bunches them."""
        waiting = rate.on_limited == "wait"
        if rate.slot is not None:  # our turn was reserved: come back for it, spend no other
            look: RateGrant = yield TakeRate(rate.key, rate.interval, 1, -1)
            wait = rate.slot - look.now
            if wait > (rate.wait_timeout if waiting else RATE_ARRIVAL_SLACK):
                return (yield from self.come_back(rate, lease, wait, rate.slot))
        else:
            horizon = 0.0 if rate.on_limited == "skip" else RATE_HORIZON
            grant: RateGrant = yield TakeRate(rate.key, rate.interval, rate.burst, horizon)
            if not grant.admitted:
                return (yield from self.rate_refused(rate, lease, grant.wait))
            wait = grant.wait
            if wait > (rate.wait_timeout if waiting else RATE_INLINE):
                return (yield from self.come_back(rate, lease, wait, grant.now + wait))
        if wait > 0:
            yield Sleep(wait)
        start: RateGrant = yield TakeRate(
            rate.key + START_SUFFIX, rate.interval, rate.burst, RATE_START_SLACK
        )
        if start.admitted:
            if start.wait > 0:
                yield Sleep(start.wait)
            self.metrics.rate_limit_waited(rate.label, wait + start.wait)
            return None
        if rate.on_limited == "skip":
            return (yield from self.rate_refused(rate, lease, start.wait))
        # The fleet's starts run more than RATE_START_SLACK behind its turns (copies came
        # late and others filled their places): a new turn, at the end of the line.
        self.metrics.rate_limit_denied(rate.label, "late")
        grant = yield TakeRate(rate.key, rate.interval, rate.burst, RATE_HORIZON)
        if not grant.admitted:
            return (yield from self.rate_refused(rate, lease, grant.wait))
        return (yield from self.come_back(rate, lease, grant.wait, grant.now + grant.wait))

    def rate_refused(self, rate: RateSpec, lease: Lease, wait: float) -> JobFlow[Outcome]:
        """No turn within reach: skipped, or (further than the horizon) back later to ask."""
        yield from self.release_quietly(lease)
        if rate.on_limited == "skip":
            self.metrics.rate_limit_denied(rate.label, "skip")
            yield Note("rate_skipped", lease.fence)
            return Outcome("rate_skipped", {**RATE_SKIPPED, "retry_after": round(wait, 3)})
        self.metrics.rate_limit_denied(rate.label, "retry")
        yield Note("rate_limited", lease.fence)
        return Outcome("rate_limited", countdown=wait, reason="rate limit")

    def come_back(self, rate: RateSpec, lease: Lease, wait: float, slot: float) -> JobFlow[Outcome]:
        """Release the lease and come back at the turn, which stays reserved for us."""
        yield from self.release_quietly(lease)
        self.metrics.rate_limit_denied(rate.label, "retry")
        yield Note("rate_limited", lease.fence)
        return Outcome("rate_limited", countdown=wait, reason="rate limit", slot=slot)

    # -- the concurrency slot ----------------------------------------------------------
    def take_slot(self, lease: Lease) -> JobFlow[SlotLease | Outcome]:
        """A slot of the job's concurrency group, taken while the job's lease is held (so a
        duplicate delivery never queues for a slot); without one in time the job's lease is
        released and the job comes back later, never lost, never run twice."""
        spec = self.spec
        started: float = yield Now()
        try:
            slot = yield from slot_flow(
                spec.concurrency_key,
                limit=spec.concurrency,
                ttl=spec.ttl,
                timeout=spec.wait_timeout,
                backoff=self.backoff,
                meta=lease.meta,
            )
        except GeneratorExit:
            raise
        except AcquireTimeout:
            yield from self.release_quietly(lease)
            self.metrics.semaphore_requeued(spec.name)
            yield Note("requeue", lease.fence)
            delay = SLOT_REQUEUE_DELAY * (1 + self.redelivery.rng.random())
            return Outcome("requeue", countdown=delay, reason="no concurrency slot free")
        except BackendUnavailable as exc:
            OUTAGE.warning(
                log,
                "lock server unavailable before job %s took its slot: %s",
                spec.key,
                type(exc).__name__,
            )
            yield from self.release_quietly(lease)
            return (yield from self.redeliver("lock server unavailable before the body ran", None))
        except BaseException:
            yield from self.release_quietly(lease)  # SemaphoreUnsupported, a bad limit
            raise
        self.metrics.semaphore_waited(spec.name, (yield Now()) - started)
        self.metrics.semaphore_acquired(spec.name, spec.concurrency)
        yield Keep(slot, tie=lease)
        return slot

    def release_slot(self, slot: SlotLease) -> JobFlow[None]:
        self.metrics.semaphore_released(self.spec.name)
        yield Drop(slot)
        with contextlib.suppress(BackendUnavailable):  # else it lapses at its TTL
            yield Release(slot)

    # -- the body and its record -------------------------------------------------------
    def run_held(
        self,
        lease: Lease,
        passthrough: tuple[type[BaseException], ...],
        slot: SlotLease | None = None,
    ) -> JobFlow[Outcome]:
        """The body under the job's (kept) lease; its record committed, or why not.

        lock_until="start": the claim is dropped first, past the rate turn and the slot, so
        a publish while this job waits for them is a duplicate of it, not queued beside it.
        """
        spec = self.spec
        if spec.claims and spec.claim_at_body:
            skipped = yield from self.claim_at_start(lease)
            if skipped is not None:
                return skipped
        ctx = JobContext(
            key=spec.key, fingerprint=spec.fingerprint, lease=lease, task_id=spec.task_id,
            slot=slot,
        )  # fmt: skip
        if self.noting:
            yield Note("started", lease.fence)
        try:
            value = yield RunBody(ctx)
            # Inside the try: an unstorable result is a failure that must release the lease.
            result = result_json(value, spec.name)
        except GeneratorExit:
            raise
        except StaleFence as exc:  # proof: a newer holder wrote
            yield from self.superseded(lease, exc)
            return Outcome("superseded", SUPERSEDED, lease.fence)
        except LeaseLost as exc:  # proof still to find
            return (yield from self.lease_lost(lease, exc))
        except CommitOutcomeUnknown as exc:  # the effect's COMMIT went unanswered, unsettled
            log.warning("job %s: its effect's commit outcome is unknown (fence=%s, %s): "
                        "delivering again", spec.key, lease.fence, exc.reason)  # fmt: skip
            yield from self.release_quietly(lease)
            return (yield from self.redeliver("effect commit outcome unknown", lease.fence))
        except passthrough:
            yield from self.release(lease)
            yield Note("released", lease.fence)
            raise
        except BaseException as exc:
            error = {"error": type(exc).__name__, "message": str(exc)[:500]}
            yield from self.finish(lease, "FAILED", canonical_json(error))
            self.metrics.executions.labels(spec.name, "failed").inc()
            yield Note("failed", lease.fence)
            raise
        # An outer block the body opened and committed itself is done: commit as usual.
        if not all(outer.committed for outer in ctx.outer):
            return (yield from self.done_after_outer_commit(lease, ctx, value, result))
        stored = yield from self.finish(lease, "DONE", result)
        if stored is None:
            # The body ran; whether its DONE record exists is unknown. Deliver again: the
            # next delivery replays the record, or runs the body again (fenced, idempotent).
            return (yield from self.redeliver("commit outcome unknown", lease.fence))
        self.metrics.task(spec.name).done.inc()
        if self.noting:
            yield Note("done", lease.fence)
        if spec.unique_for and spec.task_id:
            yield from self.throttle()
        return Outcome("ran", value, lease.fence)

    def done_after_outer_commit(
        self, lease: Lease, ctx: JobContext, value: Any, result: str
    ) -> JobFlow[Outcome]:
        """The effect committed into a caller's transaction, which may still roll back.

        Until it commits, the database's DONE row is the record that answers: the lease goes
        now, without a record, so a rollback leaves the job free to run again. A copy that
        starts meanwhile blocks on the open transaction's row locks (the fence row), then
        finds the DONE row or runs the effect; a call again inside that same transaction
        finds its own DONE row. Once every joined transaction commits, the lock server gets
        the DONE record too (`record_done`), so later deliveries are answered without a
        database round trip.
        """
        yield from self.release_quietly(lease)
        yield AfterOuterCommit(ctx, result)
        self.metrics.task(self.spec.name).done.inc()
        yield Note("released", lease.fence)
        return Outcome("ran", value, lease.fence)

    def record_done(self, result: str) -> JobFlow[None]:
        """After the caller's commit: store the DONE record under a fresh grant. Best effort:
        this runs in the caller's commit hook, and the database's DONE row answers anyway."""
        spec = self.spec
        try:
            got = yield Begin(
                spec.key, spec.ttl, default_meta(spec.task_id, spec.name), record=True,
                fingerprint=spec.record_fingerprint,
            )  # fmt: skip
            if isinstance(got, Lease):  # else a record answers already, or a copy will store it
                yield Commit(got, "DONE", result, spec.record_fingerprint, spec.result_ttl)
        except GeneratorExit:
            raise
        except Exception as exc:  # never into the caller's commit: that commit has happened
            log.warning("job %s: DONE record not stored after the caller's commit (the "
                        "database's row answers): %s", spec.key, type(exc).__name__)  # fmt: skip
        else:
            yield Note("done", None)

    def finish(self, lease: Lease, state: str, result: str) -> JobFlow[bool | None]:
        """Commit the record: True if stored, False if the lease was not ours, None if unknown.

        A commit whose reply is lost (timeout, connection error) may have run. It is
        owner-checked, so it can be sent again: a repeat of one that ran finds no lock, and
        the record then says whether it was ours. Sent at least COMMIT_ATTEMPTS times, and
        again while the lease lasts.
        """
        spec = self.spec
        yield Drop(lease)
        if lease.released:
            return False
        attempt = 0
        while True:
            try:
                stored: bool = yield Commit(
                    lease, state, result, spec.record_fingerprint, spec.result_ttl
                )
                if not stored and attempt:
                    stored = yield from self.stored_by(lease, state)
                break
            except BackendUnavailable as exc:
                attempt += 1
                if attempt >= COMMIT_ATTEMPTS and lease.deadline - lease.drift <= (yield Now()):
                    OUTAGE.warning(
                        log,
                        "job %s: %s commit outcome unknown after %d attempts (fence=%s): %s",
                        spec.key,
                        state,
                        attempt,
                        lease.fence,
                        type(exc).__name__,
                    )
                    return None
                yield Sleep(max(self.backoff.delay(attempt), 0.01))
        if not stored:
            log.warning(
                "job %s finished after its lease was lost; %s record not stored (fence=%s)",
                spec.key,
                state,
                lease.fence,
            )
        return stored

    def stored_by(self, lease: Lease, state: str) -> JobFlow[bool]:
        """After a repeated commit found no lock: did the first one store our record?"""
        record: JobRecord | None = yield ReadRecord(lease.key)
        return record is not None and record.state == state and record.fence == lease.fence

    # -- a lost lease, a newer holder --------------------------------------------------
    def lease_lost(self, lease: Lease, exc: LeaseLost) -> JobFlow[Outcome]:
        """The body stopped on a lost lease: superseded only with proof, else redeliver."""
        spec = self.spec
        yield Drop(lease)
        proof: str | None
        try:
            proof = yield from self.newer_holder(lease)
        except BackendUnavailable:
            proof = None
        if proof is not None:
            yield from self.superseded(lease, exc)
            return Outcome("superseded", SUPERSEDED, lease.fence)
        yield from self.release_quietly(lease)
        self.metrics.executions.labels(spec.name, "lease_lost").inc()
        yield Note("lease_lost", lease.fence)
        if spec.on_lease_lost == "drop":
            log.error(
                "job %s dropped after its lease was lost (fence=%s, on_lease_lost='drop'): "
                "it may have run in part and will not run again",
                spec.key,
                lease.fence,
            )
            return Outcome("dropped", DROPPED, lease.fence)
        log.warning(
            "job %s lost its lease with no newer holder in sight (fence=%s): delivering again",
            spec.key,
            lease.fence,
        )
        return (
            yield from self.redeliver("lease lost without proof of a newer holder", lease.fence)
        )

    def newer_holder(self, lease: Lease) -> JobFlow[str | None]:
        """What proves the job moved on: a DONE record, or another owner on the lock."""
        record: JobRecord | None = yield ReadRecord(self.spec.key)
        if record is not None and record.state == "DONE":
            return "done"
        info = yield Inspect(self.spec.key)
        if info is not None and info.fence != lease.fence:
            return "held"
        return None

    def superseded(self, lease: Lease, exc: BaseException) -> JobFlow[None]:
        """A newer holder wrote (a StaleFence), or holds or finished the job (LeaseLost)."""
        spec = self.spec
        stale = isinstance(exc, StaleFence)
        if stale:
            self.metrics.stale_fences.labels(spec.name).inc()
        log.warning(
            "job %s superseded by a newer holder (fence=%s): %s",
            spec.key,
            lease.fence,
            type(exc).__name__,
        )
        self.metrics.executions.labels(spec.name, "superseded").inc()
        if stale:
            yield Note("stale", lease.fence, newer=getattr(exc, "last", None))
        else:
            yield Note("superseded", lease.fence, reason="newer holder")
        yield from self.release_quietly(lease)

    # -- releasing, redelivering, giving up --------------------------------------------
    def release(self, lease: Lease) -> JobFlow[None]:
        """Release without a record (owner-checked): the keeper drops it first."""
        yield Drop(lease)
        if not lease.released:
            yield Release(lease)

    def release_quietly(self, lease: Lease) -> JobFlow[None]:
        # Owner-checked: frees the lock if the server still has it as ours; else it expires.
        with contextlib.suppress(BackendUnavailable):
            yield from self.release(lease)

    def redeliver(self, reason: str, fence: int | None) -> JobFlow[Outcome]:
        """Deliver the job again later; past the bound, record FAILED if possible and raise."""
        spec = self.spec
        if spec.redeliveries >= self.redelivery.limit:
            return (yield from self.give_up(reason))
        yield Note("redeliver", fence, reason=reason)
        return Outcome(
            "redeliver",
            fence=fence,
            countdown=self.redelivery.delay(spec.redeliveries),
            reason=reason,
        )

    def give_up(self, reason: str) -> JobFlow[Outcome]:
        """The last look: DONE replays, a live holder is a duplicate; else FAILED and raise."""
        spec = self.spec
        message = (
            f"job given up after {spec.redeliveries} redeliveries ({reason}); "
            "raise JOBFENCE_REDELIVERY_LIMIT or fix the lock server, then submit it again"
        )
        try:  # a FAILED record where one can be written, so the job's end is on record
            got = yield Begin(spec.key, spec.ttl, default_meta(spec.task_id, spec.name), True)
            if isinstance(got, JobRecord) and (
                not spec.per_run or got.fingerprint == spec.record_fingerprint
            ):
                return (yield from self.replay(got))
            if isinstance(got, Busy):
                return Outcome("duplicate", DUPLICATE, holder=got.task_id or "")
            if isinstance(got, JobRecord):  # another run's record: ours cannot be written
                raise BackendUnavailable("no record for this run", key=spec.key)
            failed = canonical_json({"error": "RedeliveryLimitReached", "message": message})
            yield Commit(got, "FAILED", failed, spec.record_fingerprint, spec.result_ttl)
        except BackendUnavailable:
            pass
        self.metrics.executions.labels(spec.name, "given_up").inc()
        yield Note("given_up", None, reason=reason)
        log.error("job %s %s", spec.key, message)
        raise RedeliveryLimitReached(message, key=spec.key)
