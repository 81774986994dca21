"""The gate: the job's lease granted, or a replay, a duplicate, a wait, a deferral, a redelivery."""

from __future__ import annotations

from jobfence.locks.backend import Busy, JobRecord, LockInfo, default_meta
from jobfence.locks.errors import AcquireTimeout, BackendUnavailable
from jobfence.locks.lease import Lease, OwnerMeta
from jobfence.locks.ops import (
    NOW,
    Begin,
    Inspect,
    ReleaseGrant,
    WaitRelease,
)
from jobfence.tasks.errors import DuplicateJob, IdempotencyConflict
from jobfence.tasks.events import Event, Kind
from jobfence.tasks.flow.ending import STARTED, fingerprints_met
from jobfence.tasks.flow.ops import JobFlow
from jobfence.tasks.flow.rotation import Rotation
from jobfence.tasks.flow.spec import DUPLICATE, Outcome


class Gate(Rotation):
    """Begin: the DONE check and the grant in one round trip, and what a refused grant means."""

    def begin(self) -> JobFlow[Lease | Outcome]:
        """Acquire the job's lease, or say why not (replay, duplicate, defer, retry, redeliver)."""
        spec = self.spec
        started: float = yield NOW
        deadline = started + spec.wait_timeout
        meta = default_meta(task_id=spec.task_id, task_name=spec.name)
        attempt = 0
        noted: str | None = "?"  # the holder whose conflict was noted last
        try:
            while True:
                got, waited_on = yield from self.look(meta)
                if isinstance(got, Outcome):
                    return got
                if isinstance(got, Lease):
                    yield Event(Kind.GRANTED, seconds=(yield NOW) - started)
                    return got
                if isinstance(got, JobRecord):
                    return (yield from self.answered(got))
                busy: Busy = got
                ours = yield from self.held(busy, attempt)
                if ours is not None:
                    return ours
                if busy.task_id != noted:
                    # Once per holder, not once per look of a wait's loop: a waiter looks
                    # every backoff step, and each look noted would flood the key's bounded
                    # log (50 decisions) and push out the decisions worth explaining.
                    noted = busy.task_id
                    yield Event(Kind.CONFLICT, None, busy.task_id or "", reason=spec.on_conflict)
                decided = yield from self.conflict(busy, attempt, deadline, waited_on)
                if decided is not None:
                    return decided
                attempt += 1
        except BackendUnavailable as exc:
            yield Event(Kind.UNAVAILABLE_BEFORE_RUN, detail=type(exc).__name__)
            return (yield from self.redeliver("lock server unavailable before the body ran", None))

    def look(self, meta: OwnerMeta) -> JobFlow[tuple[Lease | Busy | JobRecord | Outcome, str]]:
        """The DONE check and the grant in one round trip (the job under an earlier secret
        looked at too), with the key whose holder a "wait" waits for."""
        spec = self.spec
        fingerprint = spec.record_fingerprint
        got = yield Begin(spec.key, spec.ttl, meta, record=True, fingerprint=fingerprint)
        if isinstance(got, JobRecord) and spec.per_run and got.fingerprint != fingerprint:
            # An earlier run's record: this publish is a run of its own (the lock still
            # keeps it from running beside another).
            got = yield Begin(spec.key, spec.ttl, meta, False, fingerprint)
        if isinstance(got, Lease) and spec.previous:
            return (yield from self.under_previous_secret(got))
        return got, spec.key

    def answered(self, record: JobRecord) -> JobFlow[Outcome]:
        """The job's record answers: replayed, unless this copy was replaced (supersede)."""
        spec = self.spec
        if spec.supersede and spec.claims and record.fingerprint != spec.record_fingerprint:
            # Replaced, and the replacement (other arguments) already finished.
            kept = yield from self.swap_claim()
            if kept is not None and kept != STARTED + spec.task_id:
                return (yield from self.superseded_copy(None, kept))
        return (yield from self.replay(record))

    def held(self, busy: Busy, attempt: int) -> JobFlow[Outcome | None]:
        """A holder with other arguments is a conflict; our own earlier delivery, a deferral."""
        spec = self.spec
        if (
            not spec.per_run  # per run, another copy's arguments are another run's
            and busy.fingerprint
            and spec.fingerprint
            and busy.fingerprint != spec.fingerprint
        ):
            met = fingerprints_met(spec.fingerprint, busy.fingerprint)
            yield Event(Kind.IDEMPOTENCY_CONFLICT, None, busy.task_id or "", reason=met)
            raise IdempotencyConflict(
                "idempotency key in use by a running job with different arguments "
                f"({met}); use a new key or the original arguments",
                key=spec.key,
            )
        if spec.task_id and busy.task_id == spec.task_id:
            # Our own earlier delivery holds it (redelivered or crashed): come back when
            # its lease ends. Dropping this copy could lose the job if that holder died.
            yield Event(Kind.DEFER, None, busy.task_id or "")
            return Outcome("defer", countdown=self.after(busy, attempt))
        return None

    def conflict(
        self, busy: Busy, attempt: int, deadline: float, waited_on: str
    ) -> JobFlow[Outcome | None]:
        """Another delivery holds the job: the conflict policy says; None once waited a step."""
        spec = self.spec
        if spec.on_conflict == "supersede":
            return (yield from self.evict(busy, attempt, deadline, waited_on))
        if spec.on_conflict in ("skip", "raise") and spec.supersede and spec.claims:
            replaced = yield from self.replaced_holder(busy, attempt)
            if replaced is not None:
                return replaced
        if spec.on_conflict == "skip":
            return Outcome("duplicate", DUPLICATE, holder=busy.task_id or "")
        if spec.on_conflict == "raise":
            raise DuplicateJob("job is running elsewhere", key=spec.key)
        behind = spec.lock_until == "start" or spec.queues
        if spec.on_conflict == "retry":
            if behind:
                return (yield from self.behind(busy, attempt))
            return Outcome("retry", countdown=self.after(busy, attempt))
        left = deadline - (yield NOW)
        if left <= 0:
            if behind:
                return (yield from self.behind(busy, attempt))
            yield Event(Kind.TIMEOUT)
            raise AcquireTimeout(f"job still running after {spec.wait_timeout:g}s", key=spec.key)
        pause = min(left, busy.ttl_left + 0.001, max(self.backoff.delay(attempt), 0.001))
        yield WaitRelease(waited_on, pause)
        return None

    def evict(
        self, busy: Busy, attempt: int, deadline: float, key: str
    ) -> JobFlow[Outcome | None]:
        """on_conflict="supersede": the publish claim tells which copy is the newest. This
        one: the running holder's grant is removed (by its fence: a grant made since is left
        alone) and the key looked at again, to be granted with a higher fence; None. The
        holder's keeper finds its lease gone at its next extension, its fenced writes are
        refused once ours land, and it ends superseded. Another publish is newer: this copy
        is superseded itself, never run. No claim (lost with the lock server's data): the
        order is unknown, so this copy queues behind the holder and runs after it; so it does
        when grants keep changing hands past `wait_timeout`."""
        spec = self.spec
        claim = yield from self.claim_now()
        if claim == spec.task_id and (yield NOW) < deadline:
            info: LockInfo | None = yield Inspect(key)
            if info is not None and info.task_id != spec.task_id:
                yield Event(Kind.EVICTED, info.fence, info.task_id)
                yield ReleaseGrant(key, info.fence)
            return None  # look again (a grant another copy took meanwhile is judged alike)
        if claim is not None and claim.removeprefix(STARTED) != spec.task_id:
            return (yield from self.superseded_copy(None, claim))
        return (yield from self.behind(busy, attempt))

    def replaced_holder(self, busy: Busy, attempt: int) -> JobFlow[Outcome | None]:
        """on_duplicate_publish="replace": the key's claim still names this copy, unstarted,
        so the holder is not a run of this publish but a copy it replaced, which gives way
        once it sees the claim (issue 29, the long run: both ended without running). Come
        back in a moment, not skipped as its duplicate, nor refused; None otherwise."""
        if not (yield from self.claim_names_us()):
            return None  # another publish's claim, a started run's, or none: a real duplicate
        yield Event(Kind.QUEUED, None, busy.task_id or "")
        return Outcome(
            "requeue",
            # Soon: it gives way within a round trip; if it died, its lease ends in time.
            countdown=min(self.after(busy, attempt), 0.5),
            reason="a copy this publish replaced holds the key, and gives way",
        )

    def behind(self, busy: Busy, attempt: int) -> JobFlow[Outcome]:
        """Another delivery holds the key (lock_until="start": another run of it; "finish"
        through a broker: a copy of this job). This one queues behind it, as long as that
        holder lives (its lease renewed), spending neither Celery's retries nor the
        redelivery bound; it then replays the holder's DONE record ("finish") or runs. A
        holder that dies frees the key at its lease's expiry."""
        yield Event(Kind.QUEUED, None, busy.task_id or "")
        return Outcome(
            "requeue",
            countdown=self.after(busy, attempt),
            reason="another run of the key holds it",
        )
