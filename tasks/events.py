"""The job flow's typed events, and the one table that says what each means to an observer.

A flow (tasks/flow/) yields an `Event` where something worth telling happens; it
never logs or counts. `TABLE` maps each `Kind` to its row: the decision it is in the
decision log (and its words there), its log line and level, its metric update and its span
event. Middleware (tasks/middleware.py) read the row; a new observer is one class there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum, auto
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from jobfence.tasks.lifecycle import JobSpec
    from jobfence.tasks.metrics import Metrics


class Kind(StrEnum):
    """Every event a job flow yields (closed: a new one needs its row in `TABLE`)."""

    # decisions: kept in the decision log, each a span event
    STARTED = auto()
    DONE = auto()
    RECORDED = auto()  # the DONE record stored after the callers' commit ("done")
    FAILED = auto()
    RELEASED = auto()
    OUTER_PENDING = auto()  # done into callers' transactions, the lease released ("released")
    REPLAYED = auto()
    EFFECT_REPLAYED = auto()
    DEFER = auto()
    QUEUED = auto()
    CONFLICT = auto()
    EVICTED = auto()  # on_conflict="supersede": this newer publish took the key from a run
    THROTTLED = auto()
    IDEMPOTENCY_CONFLICT = auto()
    REPLACED = auto()  # a newer publish replaced this copy before it started ("superseded")
    SUPERSEDED = auto()
    STALE = auto()
    POISONED = auto()
    POISONED_AGAIN = auto()  # another copy of a dead-lettered job ("poisoned")
    RATE_SKIPPED = auto()
    RATE_LIMITED = auto()
    REQUEUE = auto()
    COMMIT_REFUSED = auto()
    LEASE_LOST = auto()
    REDELIVER = auto()
    GIVEN_UP = auto()
    FORCED = auto()  # an operator force-released the key (worker/dashboard), not a flow's
    # not decisions: a metric or a log line only
    GRANTED = auto()
    TIMEOUT = auto()
    RATE_WAITED = auto()
    RATE_LATE = auto()
    SLOT_TAKEN = auto()
    SLOT_RELEASED = auto()
    LOST_AT_COMMIT = auto()  # lease_lost counted where commit_refused was the decision
    LEASE_DROPPED = auto()
    LEASE_REDELIVERED = auto()
    EFFECT_UNKNOWN = auto()
    RECORD_NOT_STORED = auto()
    COMMIT_UNKNOWN = auto()
    COMMIT_LATE = auto()
    UNAVAILABLE_BEFORE_RUN = auto()
    UNAVAILABLE_AT_START = auto()
    UNAVAILABLE_BEFORE_SLOT = auto()
    THROTTLE_NOT_SET = auto()
    FOLLOW = auto()  # a duplicate in a workflow comes back for the running copy's result
    COMES_BACK = auto()  # its fate unknown: published again, counted as a redelivery
    COMES_BACK_IN_OUTAGE = auto()  # the same for an outage (every job at once): limited
    CLAIM_KEPT = auto()  # a publish claim the flow gave up could not be dropped
    RELEASE_UNANSWERED = auto()  # the lease a retry gives back before it goes out
    ENDED = auto()  # the delivery's outcome (its status in `reason`), for its span


class Event(NamedTuple):
    """One event of one delivery (immutable; a tuple, as cheap as the flow's hot path needs).

    `reason` is a fixed phrase (a policy, why a redelivery): it goes to the decision log.
    `detail` (an exception's type name, a dead-letter message) goes to log lines only.
    Neither ever holds a task argument."""

    kind: Kind
    fence: int | None = None
    holder: str = ""  # the other task's id where the flow knows it (a copy, a newer publish)
    newer: int | None = None  # stale: the fence the resource had accepted already
    reason: str = ""
    seconds: float = 0.0  # a wait: for the acquire, the rate turn, the slot
    attempts: int = 0  # commit attempts
    detail: str = ""


Count = Callable[["Metrics", "JobSpec", Event], None]
#: A row's `level` for warnings that go through the outage limiter (locks/outage.py).
OUTAGE = logging.WARNING + 1


@dataclass(frozen=True, slots=True)
class Row:
    """What one kind of event means: `decision` (its name in the decision log, None if it
    is none) and `phrase` (its words there); `level` and `line` (a %-style log line over
    `fields()`); `metric` (its update)."""

    decision: str | None = None
    phrase: str = ""
    level: int = 0  # 0: no log line
    line: str = ""
    metric: Count | None = None
    ends: bool = False  # the delivery's last event: its outcome

    @property
    def span(self) -> str | None:
        """The span event it is on the delivery's `jobfence.job` span (decisions only)."""
        return None if self.decision is None else "jobfence." + self.decision


def fields(spec: JobSpec, event: Event) -> dict[str, object]:
    """The names a row's `line` may use: the job's key, name, task id and the event's own."""
    return dict(event._asdict(), key=spec.key, name=spec.name, task_id=spec.task_id)


def _outcome(outcome: str) -> Count:
    return lambda m, spec, _e: m.executions.labels(spec.name, outcome).inc()


def _stale(m: Metrics, spec: JobSpec, event: Event) -> None:
    m.stale_fences.labels(spec.name).inc()
    m.executions.labels(spec.name, "superseded").inc()


def _slot_taken(m: Metrics, spec: JobSpec, event: Event) -> None:
    m.semaphore_waited(spec.name, event.seconds)
    m.semaphore_acquired(spec.name, spec.concurrency)


def _denied(action: str) -> Count:
    return lambda m, spec, _e: m.rate_limit_denied(spec.rate.label if spec.rate else "", action)


_SUPERSEDED_LINE = "job %(key)s superseded by a newer holder (fence=%(fence)s): %(detail)s"
_UNAVAILABLE = "lock server unavailable "
_COMES_BACK = ("redelivering %(name)s[%(task_id)s] in %(seconds).2fs (redelivery %(attempts)d): "
               "%(reason)s")
INFO, WARNING, ERROR = logging.INFO, logging.WARNING, logging.ERROR
K = Kind
#: The table: every kind's decision, phrase, log line and metric (a test checks it is whole).
# fmt: off
TABLE: dict[Kind, Row] = {
    K.STARTED: Row("started", "granted the lease{fence} and started the body"),
    K.DONE: Row("done", "done: granted the lease{fence}, ran the body, stored its DONE record",
                metric=lambda m, spec, _e: m.task(spec.name).done.inc()),
    K.RECORDED: Row("done"),
    K.FAILED: Row("failed", "failed: granted the lease{fence}, the body raised; FAILED record "
                  "stored", metric=_outcome("failed")),
    K.RELEASED: Row("released", "released{fence} without a record"),
    K.OUTER_PENDING: Row("released", metric=lambda m, spec, _e: m.task(spec.name).done.inc()),
    K.REPLAYED: Row("replayed", "replayed: the job's DONE record{fence} answered; the body did "
                    "not run again", metric=lambda m, spec, _e: m.replays.labels(spec.name).inc()),
    K.EFFECT_REPLAYED: Row("effect_replayed", "the body ran again{fence}; its effects' own DONE "
                           "rows answered it (it took effect in an earlier delivery, not again)"),
    K.DEFER: Row("defer", "deferred: its own earlier delivery still held the key"),
    K.QUEUED: Row("queued", "queued behind {holder}{held}, which held the key"),
    K.CONFLICT: Row("conflict", "conflict: {holder}{held} held the key",
                    metric=lambda m, s, _e: m.conflicts.labels(s.name, s.on_conflict).inc()),
    K.EVICTED: Row("evicted", "took the key from {holder}{fence}, the run of an older publish "
                   "(on_conflict='supersede'): its lease ends, its fenced writes are refused once "
                   "this run's land", INFO, "job %(key)s task %(task_id)s took the key from task "
                   "%(holder)s (fence=%(fence)s), the run of an older publish"),
    K.THROTTLED: Row("throttled", "skipped: {holder} ran the key within unique_for",
                     metric=lambda m, spec, _e: m.conflicts.labels(spec.name, "unique_for").inc()),
    K.IDEMPOTENCY_CONFLICT: Row("idempotency_conflict", "refused (IdempotencyConflict): the "
                                "key{fence} is another call's, with other arguments: {reason}"),
    K.SUPERSEDED: Row("superseded", "superseded: a newer holder took the key over{fence}",
                      WARNING, _SUPERSEDED_LINE, _outcome("superseded")),
    K.REPLACED: Row("superseded", "superseded: a newer publish ({holder}) replaced it before it "
                    "started", INFO, "job %(key)s task %(task_id)s superseded by task %(holder)s, "
                    "published to replace it", _outcome("superseded")),
    K.STALE: Row("stale", "stale write refused: fence {f} < {newer} (a newer holder wrote first)",
                 WARNING, _SUPERSEDED_LINE, _stale),
    K.POISONED: Row("poisoned", "dead-lettered{fence}: too many deliveries lost their worker "
                    "mid-body", ERROR, "dead-letter: task %(name)s key %(key)s recorded FAILED: "
                    "%(detail)s", _outcome("poisoned")),
    K.POISONED_AGAIN: Row("poisoned", "", WARNING, "task %(name)s key %(key)s: another copy of a "
                          "dead-lettered job refused (FAILED kept)", _outcome("poisoned")),
    K.RATE_SKIPPED: Row("rate_skipped", "skipped{fence}: no rate-limit turn free",
                        metric=_denied("skip")),
    K.RATE_LIMITED: Row("rate_limited", "rate limited{fence}: comes back at its turn",
                        metric=_denied("retry")),
    K.REQUEUE: Row("requeue", "requeued{fence}: no concurrency slot came free in time",
                   metric=lambda m, spec, _e: m.semaphore_requeued(spec.name)),
    K.COMMIT_REFUSED: Row("commit_refused", "lease lost{fence} before its commit: the body ran to "
                          "its end; DONE record not stored"),
    K.LEASE_LOST: Row("lease_lost", "lease lost{fence} with no newer holder in sight",
                      metric=_outcome("lease_lost")),
    K.REDELIVER: Row("redeliver", "redelivered: {reason}"),
    K.GIVEN_UP: Row("given_up", "given up: {reason}", ERROR, "job %(key)s %(detail)s",
                    _outcome("given_up")),
    K.FORCED: Row("forced", "force-released{fence} {reason}; the fence advanced to {newer}"),
    K.GRANTED: Row(metric=lambda m, spec, e: m.task(spec.name).acquire_wait.observe(e.seconds)),
    K.TIMEOUT: Row(metric=lambda m, spec, _e: m.timeouts.labels(spec.name).inc()),
    K.RATE_WAITED: Row(metric=lambda m, spec, e: m.rate_limit_waited(
        spec.rate.label if spec.rate else "", e.seconds)),
    K.RATE_LATE: Row(metric=_denied("late")),
    K.SLOT_TAKEN: Row(metric=_slot_taken),
    K.SLOT_RELEASED: Row(metric=lambda m, spec, _e: m.semaphore_released(spec.name)),
    K.LOST_AT_COMMIT: Row(metric=_outcome("lease_lost")),
    K.LEASE_DROPPED: Row(level=ERROR, line="job %(key)s dropped after its lease was lost "
                         "(fence=%(fence)s, on_lease_lost='drop'): it may have run in part and "
                         "will not run again"),
    K.LEASE_REDELIVERED: Row(level=WARNING, line="job %(key)s lost its lease with no newer holder "
                             "in sight (fence=%(fence)s): delivering again"),
    K.EFFECT_UNKNOWN: Row(level=WARNING, line="job %(key)s: its effect's commit outcome is "
                          "unknown (fence=%(fence)s, %(detail)s): delivering again"),
    K.RECORD_NOT_STORED: Row(level=WARNING, line="job %(key)s: DONE record not stored after the "
                             "caller's commit (the database's row answers): %(detail)s"),
    K.COMMIT_UNKNOWN: Row(level=OUTAGE, line="job %(key)s: %(reason)s commit outcome unknown "
                          "after %(attempts)d attempts (fence=%(fence)s): %(detail)s"),
    K.COMMIT_LATE: Row(level=WARNING, line="job %(key)s finished after its lease was lost; "
                       "%(reason)s record not stored (fence=%(fence)s)"),
    K.UNAVAILABLE_BEFORE_RUN: Row(level=OUTAGE, line=_UNAVAILABLE + "before job %(key)s ran: "
                                  "%(detail)s"),
    K.UNAVAILABLE_AT_START: Row(level=OUTAGE, line=_UNAVAILABLE + "at job %(key)s's start: "
                                "%(detail)s"),
    K.UNAVAILABLE_BEFORE_SLOT: Row(level=OUTAGE, line=_UNAVAILABLE + "before job %(key)s took its "
                                   "slot: %(detail)s"),
    K.THROTTLE_NOT_SET: Row(level=OUTAGE, line="job %(key)s: unique_for window not set: "
                            "%(detail)s"),
    K.FOLLOW: Row(level=INFO, line="%(name)s[%(task_id)s]: a copy runs as task %(holder)s; this "
                  "one comes back for its result"),
    K.COMES_BACK: Row(level=WARNING, line=_COMES_BACK),
    K.COMES_BACK_IN_OUTAGE: Row(level=OUTAGE, line=_COMES_BACK),
    K.CLAIM_KEPT: Row(level=WARNING, line="%(name)s: publish claim not cleared (%(detail)s); it "
                      "expires by its TTL"),
    K.RELEASE_UNANSWERED: Row(level=WARNING, line="task %(name)s: its lease could not be released "
                              "before its retry (lock server not answering); it ends at its TTL"),
    K.ENDED: Row(ends=True),
}
# fmt: on
#: The decision log's words for each decision, by its name there (the first row that has some).
PHRASES: dict[str, str] = {}
for _row in TABLE.values():
    if _row.decision is not None and _row.phrase:
        PHRASES.setdefault(_row.decision, _row.phrase)
#: `conflict` in words, by the conflict policy (its reason).
CONFLICT_PHRASES = {
    "skip": "skipped: a duplicate of {holder}{held} which held the key",
    "wait": "waited: {holder}{held} held the key",
    "retry": "retried later: {holder}{held} held the key",
    "raise": "refused (on_conflict='raise'): {holder}{held} held the key",
    "supersede": "met {holder}{held}, which held the key (on_conflict='supersede': the newest "
                 "publish's run stands)",
}
#: `superseded` in words when a newer publish replaced the copy (reason "replaced").
REPLACED_PHRASE = TABLE[Kind.REPLACED].phrase
#: `failed` in words when its FAILED record was not stored, or its fate is unknown (reason).
FAILED_UNSTORED_PHRASE = "failed: granted the lease{fence}, the body raised; FAILED {reason}"
