"""Ends of a delivery with no run of its own: a replay, a release, a redelivery, given up."""

from __future__ import annotations

import contextlib
import json

from jobfence.locks.backend import Busy, JobRecord, default_meta
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.flows import Backoff
from jobfence.locks.lease import Lease
from jobfence.locks.ops import Begin, Commit, Release, SwapPublish
from jobfence.tasks.errors import IdempotencyConflict
from jobfence.tasks.events import Event, Kind
from jobfence.tasks.flow.ops import Drop, JobFlow
from jobfence.tasks.flow.spec import DUPLICATE, JobSpec, Outcome, Redelivery, RedeliveryLimitReached
from jobfence.tasks.keys import canonical_json


def fingerprints_met(mine: str | None, theirs: str | None) -> str:
    """Which arguments' fingerprint met which, in a few hex digits of each: keyed digests
    (tasks.keys.fingerprint), so they tell two calls apart without showing an argument."""
    return f"this delivery's arguments {(mine or '?')[:8]}, the key's {(theirs or '?')[:8]}"


#: Prefix of a publish claim whose job has started (or finished): it can no longer be replaced.
STARTED = "!"
#: Prefix of the value a look at the publish claim writes where there is none (taken back).
PROBE = "?"


class Ending:
    """The job's state, and the ends any phase may come to: replay, release, redeliver, give up."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        backoff: Backoff,
        redelivery: Redelivery,
        noting: bool = True,
    ) -> None:
        self.spec = spec
        self.backoff = backoff
        self.redelivery = redelivery
        # False: no middleware wants routine events, so a job that runs sends no "started"
        # (an op per job for nothing); every other event is always sent.
        self.noting = noting

    def replay(self, record: JobRecord) -> JobFlow[Outcome]:
        """The job's record answers: its result, or a conflict (other arguments)."""
        spec = self.spec
        if record.fingerprint != spec.record_fingerprint:
            met = fingerprints_met(spec.record_fingerprint, record.fingerprint)
            yield Event(Kind.IDEMPOTENCY_CONFLICT, record.fence, reason=met)
            raise IdempotencyConflict(
                f"idempotency key reused with different arguments ({met}); use a new key or "
                "the original arguments",
                key=spec.key,
                fence=record.fence,
            )
        yield Event(Kind.REPLAYED, record.fence)
        return Outcome(
            "replayed", json.loads(record.result) if record.result else None, record.fence
        )

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
        yield Event(Kind.REDELIVER, fence, reason=reason)
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
        yield Event(Kind.GIVEN_UP, None, reason=reason, detail=message)
        raise RedeliveryLimitReached(message, key=spec.key)

    def claim_now(self) -> JobFlow[str | None]:
        """The job's publish claim (under this secret's key or, in a rotation, an earlier
        one's: where its publisher put it), None where there is none. A look that finds no
        claim leaves none behind: a claim made here under a key no publish used named this
        copy against the newer holder's own (issue 29, the long run: the holder, marking
        that key as it started, found it and was skipped as superseded)."""
        spec = self.spec
        # A value no publish uses: its compare-and-set reads the claim without changing one
        # that is there, and makes one only where there was none, taken back at once.
        probe = PROBE + spec.task_id
        for key in spec.claim_keys:
            held: str | None = yield SwapPublish(key, probe, probe, spec.claim_ttl)
            if held is None:
                yield SwapPublish(key, probe, None, spec.claim_ttl)
                continue
            return held
        return None
