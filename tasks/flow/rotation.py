"""A key-secret rotation at the gate: the job's grant under an earlier secret looked at, and
the tie of two grants of one job under two secrets broken alike on every worker."""

from __future__ import annotations

import dataclasses

from jobfence.locks.backend import Busy, JobRecord, LockInfo
from jobfence.locks.lease import Lease
from jobfence.locks.ops import NOW, Inspect, ReadRecord, Release, Sleep
from jobfence.tasks.events import Event, Kind
from jobfence.tasks.flow.claim import Claim
from jobfence.tasks.flow.ops import JobFlow
from jobfence.tasks.flow.spec import Outcome

#: During a key-secret rotation, how long (seconds, at most a third of the TTL) a grant
#: waits for the job's grant under another secret to go before it comes back later: the
#: other worker gives its grant back within a round trip once it sees ours.
ROTATION_GRACE = 1.0


class Rotation(Claim):
    """The grant's look under the earlier secrets of a rotation, and when to come back."""

    def after(self, busy: Busy, attempt: int) -> float:
        """When to come back: the holder's lease left, plus a jittered step."""
        return min(busy.ttl_left, 3600.0) + self.backoff.delay(attempt)

    def under_previous_secret(
        self, lease: Lease
    ) -> JobFlow[tuple[Lease | Busy | JobRecord | Outcome, str]]:
        """Our grant, unless the job's key under an earlier secret has a live holder or its
        DONE record (then that, our grant released), with the key whose holder it names.

        Looked at after the grant, the lock before the record: a commit writes the record
        and frees the lock in one step, so a run under the other secret is seen by one of
        the two looks, and two workers (one on each secret) never both miss the other's run.
        """
        spec = self.spec
        for key, fingerprint in spec.previous:
            held = yield from self.against_other_grant(lease, key)
            if held is not None:
                return held, key
            record: JobRecord | None = yield ReadRecord(key)
            run = f"{fingerprint}#{spec.task_id}" if spec.per_run else fingerprint
            if record is not None and record.state == "DONE":
                if record.fingerprint == run:  # the same job: answer with our fingerprint
                    yield Release(lease)
                    return dataclasses.replace(record, fingerprint=spec.record_fingerprint), key
                if not spec.per_run:  # other arguments under the key: a conflict
                    yield Release(lease)
                    return record, key
        return lease, spec.key

    def against_other_grant(self, lease: Lease, key: str) -> JobFlow[Busy | Outcome | None]:
        """None once `key` (the job under another secret) has no holder; else our grant
        released and why. Of two grants of one job under two secrets, each worker sees the
        other's; the tie is broken by an order every worker computes alike, whichever secret
        it calls current: the grant under the greater key keeps its lease and waits for the
        other to go, and never yields as a duplicate of it (that one may be about to yield to
        ours). If it does not go within ROTATION_GRACE, the job comes back later (requeue),
        never dropped. The grant under the lesser key yields to the greater at once."""
        spec = self.spec
        until: float | None = None
        attempt = 0
        while True:
            info: LockInfo | None = yield Inspect(key)
            if info is None:
                return None
            busy = Busy(info.ttl_left, info.task_id)
            # The other grant ranks first, or supersede (the publish claim, not the keys,
            # says which copy is newest: `evict`): yield, and our on_conflict applies.
            if spec.key < key or spec.on_conflict == "supersede":
                yield Release(lease)
                return busy
            now: float = yield NOW
            if until is None:  # our lease is not kept yet: wait well inside its TTL
                grace = max(ROTATION_GRACE, spec.wait_timeout if spec.on_conflict == "wait" else 0)
                until = now + min(grace, spec.ttl / 3)
            if now >= until:
                yield Release(lease)
                if spec.task_id and info.task_id == spec.task_id:
                    return busy  # our own message's other copy: deferred as ever
                yield Event(Kind.QUEUED, None, info.task_id)
                return Outcome(
                    "requeue",
                    countdown=self.after(busy, attempt),
                    reason="a grant of the job under another key secret holds it",
                )
            # A sleep, not WaitRelease: only a lock that refused a grant signals its release.
            yield Sleep(min(until - now, max(self.backoff.delay(attempt), 0.001)))
            attempt += 1
