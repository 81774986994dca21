"""One delivery of a job, start to end: `deliver()` and `run()` are the safety argument's
table of contents."""

from __future__ import annotations

from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.flows import Backoff
from jobfence.locks.lease import Lease
from jobfence.tasks.events import Event, Kind
from jobfence.tasks.flow.admission import Admission
from jobfence.tasks.flow.body import Body
from jobfence.tasks.flow.gate import Gate
from jobfence.tasks.flow.ops import JobFlow, Keep
from jobfence.tasks.flow.spec import JobSpec, Outcome, Redelivery
from jobfence.tasks.flow.verdict import Verdict, Verdicts


def job_flow(
    spec: JobSpec,
    *,
    backoff: Backoff,
    redelivery: Redelivery,
    passthrough: tuple[type[BaseException], ...] = (),
) -> JobFlow[Outcome]:
    """One delivery of `spec`, start to end: the body run once under the job's lease, its
    record committed, or why not. Exceptions in `passthrough` release without a record."""
    return Job(spec, backoff=backoff, redelivery=redelivery).run(passthrough)


def delivery_flow(
    spec: JobSpec,
    *,
    backoff: Backoff,
    redelivery: Redelivery,
    passthrough: tuple[type[BaseException], ...] = (),
) -> JobFlow[Verdict]:
    """One delivery of `spec` to its verdict: what the shell does (tasks/flow/verdict.py)."""
    return Job(spec, backoff=backoff, redelivery=redelivery).deliver(passthrough)


def ended_event(out: Outcome) -> Event:
    """What the delivery came to, told last (its span's outcome)."""
    return Event(Kind.ENDED, out.fence, reason=out.status)


class Job(Gate, Admission, Body, Verdicts):
    """The decisions for one delivery of a job, as flows (generator methods): what it does
    and what it has to tell (an `Event`, for the shell's middleware) are ops.

    Round trips on Redis for a job that runs: one `Begin` (DONE check and grant), one
    `Commit` (DONE record and release), plus the keeper's batched extensions.
    """

    def deliver(self, passthrough: tuple[type[BaseException], ...] = ()) -> JobFlow[Verdict]:
        """The delivery's run, then its verdict (verdict.py); a delivery that raised gives
        its publish claim up first, so the job may be submitted afresh."""
        try:
            out = yield from self.run(passthrough)  # `ended`, a generator level less
            yield ended_event(out)
        except GeneratorExit:
            raise  # closed unrun: nothing to send
        except passthrough:
            raise  # Celery's own ends (a retry, Ignore, Reject): the claim stays
        except BaseException:
            yield from self.drop_claim_after_failure()
            raise
        return (yield from self.verdict(out))

    def ended(self, passthrough: tuple[type[BaseException], ...] = ()) -> JobFlow[Outcome]:
        """The delivery's run, and its outcome told (for its span)."""
        out = yield from self.run(passthrough)
        yield ended_event(out)
        return out

    def let_go(self, lease: Lease) -> JobFlow[None]:
        """A retry goes out from the body: the lease first, so the retried copy never
        waits on it. Unanswered, it ends at its TTL (the copy defers until then)."""
        try:
            yield from self.release(lease)
        except BackendUnavailable:
            yield Event(Kind.RELEASE_UNANSWERED, lease.fence)

    def run(self, passthrough: tuple[type[BaseException], ...] = ()) -> JobFlow[Outcome]:
        """Begin, claim, cap, keep, rate gate, slot, body, commit (design §1's three layers)."""
        spec = self.spec
        # gate.py: the record replays (layer 3) or the lease is granted (layer 1), with its fence
        got = yield from self.begin()
        if isinstance(got, Outcome):
            return got
        lease = got
        # claim.py: the publish claim marked started; admission.py: crash cap, rate turn, slot
        if spec.claims and not spec.claim_at_body:
            skipped = yield from self.claim_at_start(lease)
            if skipped is not None:
                return skipped
        if spec.suspect and spec.max_crashed:
            yield from self.cap_crashes(lease)
        yield Keep(lease, watch=spec.on_conflict == "supersede")
        if spec.rate is not None:
            held = yield from self.rate_gate(spec.rate, lease)
            if held is not None:
                return held
        # body.py, in the slot if any: the body once under the kept lease, its writes fenced
        # (layer 2); settle.py: its record committed as the lease goes (layer 3), or why not
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
