"""Admission, the lease held: the crash cap, the global rate limit's turn, the concurrency slot."""

from __future__ import annotations

import contextlib
import hashlib

from jobfence.locks.backend import RateGrant
from jobfence.locks.errors import AcquireTimeout, BackendUnavailable
from jobfence.locks.flows import slot_flow
from jobfence.locks.lease import Lease
from jobfence.locks.ops import NOW, CountDelivery, Release, Sleep, TakeRate
from jobfence.locks.slots import SlotLease
from jobfence.tasks.errors import PoisonMessage
from jobfence.tasks.events import Event, Kind
from jobfence.tasks.flow.ops import Drop, JobFlow, Keep
from jobfence.tasks.flow.settle import Settle
from jobfence.tasks.flow.spec import RATE_SKIPPED, Outcome, RateSpec
from jobfence.tasks.keys import canonical_json

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

#: A job that found no concurrency slot in time comes back after 1-2 times this (seconds).
SLOT_REQUEUE_DELAY = 1.0


class Admission(Settle):
    """What may still hold a granted job back before its body: crashes, its rate, its slot."""

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
        first = count == spec.max_crashed + 1  # the dead-letter line once, then "another copy"
        yield Event(Kind.POISONED if first else Kind.POISONED_AGAIN, lease.fence, detail=message)
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
            yield Event(Kind.UNAVAILABLE_BEFORE_RUN, detail=type(exc).__name__)
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
            yield Event(Kind.RATE_WAITED, seconds=wait + start.wait)
            return None
        if rate.on_limited == "skip":
            return (yield from self.rate_refused(rate, lease, start.wait))
        # The fleet's starts run more than RATE_START_SLACK behind its turns (copies came
        # late and others filled their places): a new turn, at the end of the line.
        yield Event(Kind.RATE_LATE)
        grant = yield TakeRate(rate.key, rate.interval, rate.burst, RATE_HORIZON)
        if not grant.admitted:
            return (yield from self.rate_refused(rate, lease, grant.wait))
        return (yield from self.come_back(rate, lease, grant.wait, grant.now + grant.wait))

    def rate_refused(self, rate: RateSpec, lease: Lease, wait: float) -> JobFlow[Outcome]:
        """No turn within reach: skipped, or (further than the horizon) back later to ask."""
        yield from self.release_quietly(lease)
        if rate.on_limited == "skip":
            yield Event(Kind.RATE_SKIPPED, lease.fence)
            return Outcome("rate_skipped", {**RATE_SKIPPED, "retry_after": round(wait, 3)})
        yield Event(Kind.RATE_LIMITED, lease.fence)
        return Outcome("rate_limited", countdown=wait, reason="rate limit")

    def come_back(self, rate: RateSpec, lease: Lease, wait: float, slot: float) -> JobFlow[Outcome]:
        """Release the lease and come back at the turn, which stays reserved for us."""
        yield from self.release_quietly(lease)
        yield Event(Kind.RATE_LIMITED, lease.fence)
        return Outcome("rate_limited", countdown=wait, reason="rate limit", slot=slot)

    # -- the concurrency slot ----------------------------------------------------------
    def take_slot(self, lease: Lease) -> JobFlow[SlotLease | Outcome]:
        """A slot of the job's concurrency group, taken while the job's lease is held (so a
        duplicate delivery never queues for a slot); without one in time the job's lease is
        released and the job comes back later, never lost, never run twice."""
        spec = self.spec
        started: float = yield NOW
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
            yield Event(Kind.REQUEUE, lease.fence)
            delay = SLOT_REQUEUE_DELAY * (1 + self.redelivery.rng.random())
            return Outcome("requeue", countdown=delay, reason="no concurrency slot free")
        except BackendUnavailable as exc:
            yield Event(Kind.UNAVAILABLE_BEFORE_SLOT, detail=type(exc).__name__)
            yield from self.release_quietly(lease)
            return (yield from self.redeliver("lock server unavailable before the body ran", None))
        except BaseException:
            yield from self.release_quietly(lease)  # SemaphoreUnsupported, a bad limit
            raise
        yield Event(Kind.SLOT_TAKEN, seconds=(yield NOW) - started)
        yield Keep(slot, tie=lease)
        return slot

    def release_slot(self, slot: SlotLease) -> JobFlow[None]:
        yield Event(Kind.SLOT_RELEASED)
        yield Drop(slot)
        with contextlib.suppress(BackendUnavailable):  # else it lapses at its TTL
            yield Release(slot)
