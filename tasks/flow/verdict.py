"""What a delivery comes to, decided once: a closed, typed verdict the shells carry out.

A shell (Celery's task, Django's backend) never reads a status: it matches the verdict.
`Value` returns; `Stop` raises its typed stop; `ComeBack` publishes this message again
with its `marks` (or retries); `NotSettled` says the job's fate is unknown where there is
no broker to come back through. A copy carries `Marks` (tasks/flow/marks.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.ops import ReadRecord, SwapPublish
from jobfence.tasks.errors import (
    DuplicateSkipped,
    JobDropped,
    JobSkipped,
    JobSuperseded,
    RateLimitSkipped,
)
from jobfence.tasks.events import Event, Kind
from jobfence.tasks.flow.ending import STARTED, Ending
from jobfence.tasks.flow.marks import Marks
from jobfence.tasks.flow.ops import JobFlow
from jobfence.tasks.flow.spec import Outcome


@dataclass(frozen=True, slots=True)
class Value:
    """The job's result: it ran, or its DONE record answered."""

    value: Any
    fence: int | None = None


@dataclass(frozen=True, slots=True)
class Stop:
    """No result of its own: the shell raises `error`, so no workflow takes a marker for
    the task's result (design §9)."""

    error: JobSkipped


@dataclass(frozen=True, slots=True)
class ComeBack:
    """Publish this message again in `countdown` seconds, marked `marks`, and end this
    delivery with no result (the copy has the same task id). `retry`: a Celery retry
    instead (counted against `max_retries`)."""

    countdown: float
    marks: Marks
    retry: bool = False
    reason: str = ""  # why it is not settled now, for a shell with no broker (Django's)
    fence: int | None = None


@dataclass(frozen=True, slots=True)
class NotSettled:
    """The job's fate is unknown and there is no broker to come back through (an eager or
    direct call, Django's backend): call it again."""

    reason: str
    fence: int | None = None


Verdict = Value | Stop | ComeBack | NotSettled

#: Each status that ends a delivery with no result of its own: its typed stop and why.
STOPS: Final[dict[str, tuple[type[JobSkipped], str]]] = {
    "duplicate": (DuplicateSkipped, "a copy of this job is running, or ran within unique_for; "
                  "acked without running (on_conflict='skip'); that copy's result answers"),
    "superseded": (JobSuperseded, "a newer copy took this job over before its result was on "
                   "record"),
    "dropped": (JobDropped, "the lease was lost mid-body and the job is not run again "
                "(on_lease_lost='drop'); it may have run in part"),
    "rate_skipped": (RateLimitSkipped, "no global rate limit turn was free; not run "
                     "(on_rate_limited='skip')"),
}  # fmt: skip


class Verdicts(Ending):
    """The delivery's outcome turned into what the shell does, with the lock-server calls
    that takes (a superseded copy's record, a publish claim given up)."""

    def verdict(self, out: Outcome) -> JobFlow[Verdict]:
        """The one decision from outcome to verdict (design §8's table)."""
        spec = self.spec
        status = out.status
        if status in ("ran", "replayed"):
            return Value(out.value, out.fence)
        if status == "superseded":
            answered = yield from self.answered_by_record()
            if answered is not None:
                return answered
        if status == "duplicate" and self.follows(out):
            # Back once the running copy's lease would have ended, when its DONE record
            # answers; if that copy failed, the comeback runs the job, as a publish would.
            yield Event(Kind.FOLLOW, out.fence, out.holder)
            return ComeBack(self.capped(spec.ttl), spec.marks.copy(), reason="a copy runs")
        if status == "rate_skipped" and spec.publish_claim:
            # It never ran: a new submission may go out.
            yield from self.drop_claim(spec.task_id)
        if status in STOPS:
            return Stop(self.stop_error(out))
        if status == "retry":
            return self.copy_of(out, spec.marks.copy(), retry=True)
        if status == "defer":  # a grant of the copy counts towards the poison cap
            return self.copy_of(out, spec.marks.copy(deferred=True))
        if status == "rate_limited":
            return self.copy_of(out, spec.marks.copy(rate_slot=out.slot))
        if not spec.queues:
            return NotSettled(out.reason, out.fence)
        if status == "requeue":
            return self.copy_of(out, spec.marks.copy())
        back = self.copy_of(out, spec.marks.copy(redeliveries=spec.redeliveries + 1))
        outage = "unavailable" in out.reason  # every job comes back at once: limited lines
        yield Event(Kind.COMES_BACK_IN_OUTAGE if outage else Kind.COMES_BACK, out.fence,
                    reason=out.reason, seconds=back.countdown,
                    attempts=back.marks.redeliveries)  # fmt: skip
        return back

    def copy_of(self, out: Outcome, marks: Marks, *, retry: bool = False) -> ComeBack:
        """This message again after the outcome's countdown (capped), marked `marks`."""
        return ComeBack(self.capped(out.countdown), marks, retry, out.reason or out.status,
                        out.fence)  # fmt: skip

    def capped(self, countdown: float) -> float:
        """A countdown the broker would outwait redelivers the message while it waits; coming
        back early only means deferring once more."""
        return min(countdown, self.spec.countdown_cap)

    def follows(self, out: Outcome) -> bool:
        """Whether a skipped duplicate waits for the running copy's result: only where a
        workflow needs data from it, through a broker, and where that copy's DONE record
        will answer this very job (not a run of its own)."""
        spec = self.spec
        return bool(
            out.holder
            and spec.on_conflict == "skip"
            and not (spec.per_run or spec.claims)
            and spec.queues
            and spec.in_workflow
        )

    def answered_by_record(self) -> JobFlow[Value | None]:
        """A superseded copy answers with the job's DONE record when it is already there
        (the newer holder ran this very job), as a later delivery would."""
        spec = self.spec
        try:
            record = yield ReadRecord(spec.key)
        except BackendUnavailable:  # no answer: the typed stop says why
            return None
        if record is None or record.state != "DONE":
            return None
        if record.fingerprint != spec.record_fingerprint:
            return None
        return Value(json.loads(record.result) if record.result else None, record.fence)

    def stop_error(self, out: Outcome) -> JobSkipped:
        spec = self.spec
        stop, reason = STOPS[out.status]
        if stop is DuplicateSkipped or stop is JobSuperseded:
            held = f" (task {out.holder})" if out.holder else ""
            return stop(f"{spec.name}: {reason}{held}", out.holder, key=spec.key)
        if stop is RateLimitSkipped:
            after = float((out.value or {}).get("retry_after", 0.0))
            return RateLimitSkipped(f"{spec.name}: {reason} (retry after {after:g}s)", after,
                                    key=spec.key)  # fmt: skip
        return stop(f"{spec.name}: {reason}", key=spec.key)

    def drop_claim(self, mine: str) -> JobFlow[None]:
        """Drop the publish claim if it is still `mine`, never letting the lock server's
        failure replace the delivery's own outcome: the claim then expires by its TTL."""
        spec = self.spec
        try:
            for key in spec.claim_keys:  # owner-checked under each secret's key
                yield SwapPublish(key, mine, None, spec.claim_ttl)
        except Exception as exc:  # the clean-up's failure, whatever it is, must not win
            yield Event(Kind.CLAIM_KEPT, detail=type(exc).__name__)

    def drop_claim_after_failure(self) -> JobFlow[None]:
        """The delivery raised: a failed job may be submitted afresh. Owner-checked, as the
        claim may be a newer copy's by now (or a copy published around it, a workflow's)."""
        spec = self.spec
        if spec.claims:  # lock_until="start" keeps the claim unmarked until the body starts
            yield from self.drop_claim(spec.task_id if spec.claim_at_body
                                       else STARTED + spec.task_id)  # fmt: skip
        elif spec.publish_claim:
            yield from self.drop_claim(spec.task_id)
