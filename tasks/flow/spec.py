"""One delivery of a job (`JobSpec`, `RateSpec`, `Redelivery`) and what became of it (`Outcome`)."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from jobfence.tasks.errors import TaskError
from jobfence.tasks.flow.marks import UNMARKED, Marks
from jobfence.tasks.options import (
    DEFAULTS,
    ConflictPolicy,
    LeaseLostPolicy,
    LockUntil,
    RateLimitedPolicy,
)

Status = Literal[
    "ran",
    "replayed",
    "duplicate",
    "superseded",
    "defer",
    "retry",
    "redeliver",
    "dropped",
    "requeue",
    "rate_limited",
    "rate_skipped",
]
#: How far ahead a delivery may reserve its turn under a global rate limit; a job whose turn

DUPLICATE = {"jobfence": "duplicate"}
SUPERSEDED = {"jobfence": "superseded"}
DROPPED = {"jobfence": "dropped"}
RATE_SKIPPED = {"jobfence": "rate_limited"}


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
    on_limited: RateLimitedPolicy = DEFAULTS.on_rate_limited
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
    # A FAILED record keeps the exception's type; its message only when asked for
    # (JOBFENCE_FAILED_RECORD_MESSAGE): a message may hold what the key's HMAC hides.
    failed_message: bool = False
    on_conflict: ConflictPolicy = DEFAULTS.on_conflict
    wait_timeout: float = 10.0
    on_lease_lost: LeaseLostPolicy = DEFAULTS.on_lease_lost
    redeliveries: int = 0  # how often this job already came back with its fate unknown
    # This delivery may follow one that died mid-body (broker redelivery, or our deferred
    # copy of one); such grants are counted per run, and past `max_crashed` the job is
    # recorded FAILED instead of run again (0: no cap).
    suspect: bool = False
    max_crashed: int = 0
    # Lock lifetimes (docs/explanation/lifetimes.md). `lock_until="start"`
    # drops the publish claim when the body starts (past its rate turn and slot); `unique_for`
    # keeps it that many seconds after the run finished. With either, each publish is a run of
    # its own: its DONE record answers its own redeliveries, not a later publish of the key.
    lock_until: LockUntil = DEFAULTS.lock_until
    unique_for: float = 0.0
    claim_ttl: float = 60.0  # the publish claim's TTL while the job runs
    # on_duplicate_publish="replace": a publish claim held by another copy proves this one
    # was replaced before it started, so it is skipped as superseded.
    supersede: bool = False
    publish_claim: bool = False  # dedupe_on_publish: the key has a publish claim to update
    # debounce and on_conflict="supersede": a run keeps its claim's mark (a newer publish
    # replaces it); debounce_max_wait: where the burst's first publish time is kept (cleared
    # at the run)
    replaces_started: bool = False
    burst_key: str = ""
    # Delivered through a broker: a wait/retry conflict can queue behind the live holder (this
    # message published again) under any lock_until, instead of spending Celery's retries or
    # giving up at wait_timeout while the job it waits for still runs.
    queues: bool = False

    # At most `concurrency` jobs of the group `concurrency_key` run at once (0: no limit);
    # a job waits up to `wait_timeout` for a slot, then comes back later ("requeue").
    concurrency: int = DEFAULTS.concurrency
    concurrency_key: str = ""
    rate: RateSpec | None = None
    # (key, fingerprint) of the job under each earlier key secret (a rotation): looked up
    # for its DONE record or a live holder, never granted.
    previous: tuple[tuple[str, str], ...] = ()
    # What the delivered message carries (its explicit key, counts), for a copy of it.
    marks: Marks = UNMARKED
    # The longest a copy may wait to come back: one the broker would outwait is redelivered
    # while it waits (half its visibility timeout).
    countdown_cap: float = math.inf
    # A chain, group, chord or link waits on this delivery's result (a skipped duplicate
    # then comes back for the running copy's).
    in_workflow: bool = False

    def but(self, **changes: Any) -> JobSpec:
        """This spec with `changes`: a delivery's spec is its task's template (built once)
        plus what its message says, without the generated __init__'s per-field cost, paid
        on every delivery (issue 32: about a tenth of the gated call's own Python)."""
        if not changes.keys() <= _FIELD_NAMES:  # a subset test builds no set
            unknown = changes.keys() - _FIELD_NAMES
            raise TypeError(f"JobSpec has no field {sorted(unknown)[0]!r}")
        spec = object.__new__(JobSpec)
        fields = spec.__dict__
        fields.update(self.__dict__)
        fields.update(changes)
        return spec

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
    def claim_keys(self) -> tuple[str, ...]:
        """Where the job's publish claim may be: its key, then its key under each earlier
        secret (a rotation: a run under either secret marks and reads both)."""
        return (self.key, *(key for key, _ in self.previous))

    @property
    def claims(self) -> bool:
        """Whether this delivery reads and updates the key's publish claim at start."""
        return bool(self.task_id) and (
            self.supersede
            or self.unique_for > 0
            or (self.lock_until == "start" and self.publish_claim)
        )


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(JobSpec))


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
