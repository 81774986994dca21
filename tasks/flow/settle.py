"""Settling a run: its record committed (or after the caller's commit), or a lost lease judged."""

from __future__ import annotations

from typing import Any

from jobfence.locks.backend import JobRecord, default_meta
from jobfence.locks.errors import BackendUnavailable, LeaseLost, StaleFence
from jobfence.locks.lease import Lease
from jobfence.locks.ops import NOW, Begin, Commit, Inspect, ReadRecord, Sleep
from jobfence.tasks.context import JobContext
from jobfence.tasks.events import Event, Kind
from jobfence.tasks.flow.ending import STARTED, Ending
from jobfence.tasks.flow.ops import AfterOuterCommit, Drop, JobFlow
from jobfence.tasks.flow.spec import DROPPED, SUPERSEDED, Outcome

#: Commit attempts (at least) when the reply to a commit is lost; more while the lease lasts.
COMMIT_ATTEMPTS = 3
#: Why a job whose body ended is delivered again when its commit was refused, lease gone.
LOST_BEFORE_COMMIT = "lease lost before commit; DONE record not stored"
#: The proof of a newer publish's run (supersede), before that publish's task id.
REPLACED_BY = "replaced by "
#: A FAILED record's fate where it is not stored (finish: False refused, None unknown).
NOT_STORED = {False: "record not stored: lease lost", None: "record outcome unknown"}


class Settle(Ending):
    """The record of a run: stored, refused (the lease was lost), or unknown (redeliver)."""

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
        yield Event(Kind.OUTER_PENDING, lease.fence)
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
            yield Event(Kind.RECORD_NOT_STORED, detail=type(exc).__name__)
        else:
            yield Event(Kind.RECORDED)

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
                if attempt >= COMMIT_ATTEMPTS and lease.deadline - lease.drift <= (yield NOW):
                    yield Event(Kind.COMMIT_UNKNOWN, lease.fence, reason=state, attempts=attempt,
                                detail=type(exc).__name__)  # fmt: skip
                    return None
                yield Sleep(max(self.backoff.delay(attempt), 0.01))
        if not stored:
            yield Event(Kind.COMMIT_LATE, lease.fence, reason=state)
        return stored

    def stored_by(self, lease: Lease, state: str) -> JobFlow[bool]:
        """After a repeated commit found no lock: did the first one store our record?"""
        record: JobRecord | None = yield ReadRecord(lease.key)
        return record is not None and record.state == state and record.fence == lease.fence

    # -- a lost lease, a newer holder --------------------------------------------------
    def commit_refused(self, lease: Lease) -> JobFlow[Outcome]:
        """The body ran to its end but its commit was refused: the lease was gone (expired
        unnoticed past a pause, force-released, lost with the lock server's data), so no DONE
        record was stored. Never reported done: superseded with proof of a newer holder or a
        DONE record, else the effect's outcome is unknown from here and the job is delivered
        again (its effects' own DONE rows answer the body, design §7)."""
        yield Event(Kind.COMMIT_REFUSED, lease.fence)
        lost = LeaseLost("commit refused: the lease was lost", key=lease.key, fence=lease.fence)
        return (yield from self.lease_lost(lease, lost, at_commit=True))

    def lease_lost(
        self, lease: Lease, exc: LeaseLost, *, at_commit: bool = False
    ) -> JobFlow[Outcome]:
        """The body stopped on a lost lease (or, `at_commit`, ended and its commit was
        refused, noted already): superseded only with proof, else redeliver."""
        spec = self.spec
        yield Drop(lease)
        proof: str | None
        try:
            proof = yield from self.newer_holder(lease)
        except BackendUnavailable:
            proof = None
        if proof is not None:
            yield from self.superseded(lease, exc)
            # Superseded by a newer publish: its task stands for this one (its AsyncResult).
            newer = proof.removeprefix(REPLACED_BY) if proof.startswith(REPLACED_BY) else ""
            return Outcome("superseded", SUPERSEDED, lease.fence, holder=newer)
        yield from self.release_quietly(lease)
        # At the commit, "commit_refused" was the decision; the loss is counted all the same.
        yield Event(Kind.LOST_AT_COMMIT if at_commit else Kind.LEASE_LOST, lease.fence)
        if spec.on_lease_lost == "drop":
            yield Event(Kind.LEASE_DROPPED, lease.fence)
            return Outcome("dropped", DROPPED, lease.fence)
        yield Event(Kind.LEASE_REDELIVERED, lease.fence)
        reason = LOST_BEFORE_COMMIT if at_commit else "lease lost without proof of a newer holder"
        return (yield from self.redeliver(reason, lease.fence))

    def newer_holder(self, lease: Lease) -> JobFlow[str | None]:
        """What proves the job moved on: a DONE record, or another owner on the lock; under
        on_conflict="supersede", a publish claim naming a newer publish (one naming this
        copy proves nothing: an older copy took the key meanwhile and gives way at its start)."""
        spec = self.spec
        if spec.on_conflict == "supersede":
            claim = yield from self.claim_now()
            if claim is not None:
                newer = claim.removeprefix(STARTED)
                return REPLACED_BY + newer if newer != spec.task_id else None
        record: JobRecord | None = yield ReadRecord(self.spec.key)
        if record is not None and record.state == "DONE":
            return "done"
        info = yield Inspect(self.spec.key)
        if info is not None and info.fence != lease.fence:
            return "held"
        return None

    def superseded(self, lease: Lease, exc: BaseException) -> JobFlow[None]:
        """A newer holder wrote (a StaleFence), or holds or finished the job (LeaseLost)."""
        error = type(exc).__name__
        if isinstance(exc, StaleFence):
            yield Event(Kind.STALE, lease.fence, newer=exc.last, detail=error)
        else:
            yield Event(Kind.SUPERSEDED, lease.fence, reason="newer holder", detail=error)
        yield from self.release_quietly(lease)
