"""The body under the job's kept lease, its value or what it raised settled into a record."""

from __future__ import annotations

from typing import Any

from jobfence.locks.errors import CommitOutcomeUnknown, LeaseLost, StaleFence
from jobfence.locks.lease import Lease
from jobfence.locks.slots import SlotLease
from jobfence.tasks.context import JobContext
from jobfence.tasks.events import Event, Kind
from jobfence.tasks.flow.claim import Claim
from jobfence.tasks.flow.ops import JobFlow, RunBody
from jobfence.tasks.flow.settle import NOT_STORED, Settle
from jobfence.tasks.flow.spec import SUPERSEDED, Outcome
from jobfence.tasks.keys import canonical_json, result_json


class Body(Claim, Settle):
    """Run the body once, under the lease; commit its record, or say why not."""

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
        if spec.claim_at_body and spec.claims:
            skipped = yield from self.claim_at_start(lease)
            if skipped is not None:
                return skipped
        ctx = JobContext.of(spec.key, spec.fingerprint, lease, spec.task_id, slot, spec.previous,
                            spec.per_run)  # fmt: skip
        if self.noting:
            yield Event(Kind.STARTED, lease.fence)
        return (yield from self.run_body(lease, ctx, passthrough))

    def run_body(
        self, lease: Lease, ctx: JobContext, passthrough: tuple[type[BaseException], ...]
    ) -> JobFlow[Outcome]:
        """The body once: its value settled (`commit_done`), or what it raised answered."""
        spec = self.spec
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
            yield Event(Kind.EFFECT_UNKNOWN, lease.fence, detail=exc.reason)
            yield from self.release_quietly(lease)
            return (yield from self.redeliver("effect commit outcome unknown", lease.fence))
        except passthrough:
            yield from self.release(lease)
            yield Event(Kind.RELEASED, lease.fence)
            raise
        except BaseException as exc:
            error = {"error": type(exc).__name__}
            if spec.failed_message:
                error["message"] = str(exc)[:500]
            stored = yield from self.finish(lease, "FAILED", canonical_json(error))
            yield Event(Kind.FAILED, lease.fence, reason=NOT_STORED.get(stored, ""))
            raise
        return (yield from self.commit_done(lease, ctx, value, result))

    def commit_done(
        self, lease: Lease, ctx: JobContext, value: Any, result: str
    ) -> JobFlow[Outcome]:
        """The body returned: its DONE record committed (after the caller's, if joined)."""
        spec = self.spec
        if ctx.effects and all(ctx.effects):  # the effects' own DONE rows answered the body
            yield Event(Kind.EFFECT_REPLAYED, lease.fence)
        # An outer block the body opened and committed itself is done: commit as usual.
        if not all(outer.committed for outer in ctx.outer):
            return (yield from self.done_after_outer_commit(lease, ctx, value, result))
        stored = yield from self.finish(lease, "DONE", result)
        if stored is None:
            # The body ran; whether its DONE record exists is unknown. Deliver again: the
            # next delivery replays the record, or runs the body again (fenced, idempotent).
            return (yield from self.redeliver("commit outcome unknown", lease.fence))
        if not stored:
            return (yield from self.commit_refused(lease))
        yield Event(Kind.DONE, lease.fence)
        if spec.unique_for and spec.task_id:
            yield from self.throttle()
        return Outcome("ran", value, lease.fence)
