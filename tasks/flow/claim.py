"""The publish claim at start: marked started (or dropped), a replaced copy skipped, a throttle."""

from __future__ import annotations

import contextlib

from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import Lease
from jobfence.locks.ops import ClearPublish, SwapPublish
from jobfence.tasks.events import Event, Kind
from jobfence.tasks.flow.ending import STARTED, Ending
from jobfence.tasks.flow.ops import JobFlow
from jobfence.tasks.flow.spec import DUPLICATE, SUPERSEDED, Outcome


class Claim(Ending):
    """The key's publish claim, read and updated when the job starts and after it ran."""

    def claim_at_start(self, lease: Lease) -> JobFlow[Outcome | None]:
        """Mark the publish claim started (or drop it, lock_until="start"), holding the
        lease; None to run. A claim another copy holds proves this copy was replaced
        (supersede), or, marked started, that the key ran within `unique_for` (throttled),
        under this secret's key or, in a rotation, an earlier secret's."""
        spec = self.spec
        mine = STARTED + spec.task_id
        try:
            kept = yield from self.swap_claim()
            if spec.previous and (kept is None or kept == mine):
                kept = yield from self.claim_under_earlier_secrets()
        except BackendUnavailable as exc:
            yield Event(Kind.UNAVAILABLE_AT_START, detail=type(exc).__name__)
            yield from self.release_quietly(lease)
            return (yield from self.redeliver("lock server unavailable before the body ran", None))
        if kept is None or kept == mine:
            if spec.burst_key:  # debounce: this run ends the burst; the next starts afresh
                yield from self.end_burst()
            return None
        if spec.supersede:
            return (yield from self.superseded_copy(lease, kept))
        if spec.unique_for and kept.startswith(STARTED):
            return (yield from self.throttled(lease, kept.removeprefix(STARTED)))
        return None

    def end_burst(self) -> JobFlow[None]:
        """Forget the debounced burst's first publish: a publish from now on starts the next."""
        # Unanswered: nothing to record, it lapses after debounce_max_wait on its own.
        with contextlib.suppress(BackendUnavailable):
            yield ClearPublish(self.spec.burst_key)

    def throttled(self, lease: Lease, holder: str) -> JobFlow[Outcome]:
        """`holder`'s run of the key started within `unique_for`: skipped, its result answers."""
        yield Event(Kind.THROTTLED, lease.fence, holder)
        yield from self.release_quietly(lease)
        return Outcome("duplicate", DUPLICATE, lease.fence, holder=holder)

    def claim_names_us(self) -> JobFlow[bool]:
        """Whether the job's publish claim still names this copy, queued."""
        return (yield from self.claim_now()) == self.spec.task_id

    def swap_claim(self) -> JobFlow[str | None]:
        """Our claim marked started (dropped under lock_until="start"); else who holds it."""
        spec = self.spec
        kept: str | None = yield SwapPublish(spec.key, spec.task_id, self.marked, spec.claim_ttl)
        return kept

    @property
    def marked(self) -> str | None:
        """The claim as the run starts: marked started, or dropped under lock_until="start"
        (debounce and supersede keep the mark: an older copy is superseded by it)."""
        spec = self.spec
        if spec.lock_until == "start" and not spec.replaces_started:
            return None
        return STARTED + spec.task_id

    def claim_under_earlier_secrets(self) -> JobFlow[str | None]:
        """A rotation: the claim marked started (or dropped) under each earlier secret's
        key too, where a publish under that secret put it, so the job's claim reads alike
        under every key. Issue 29, the long run: a run under secret B marked only B's key
        and lost its lease; the next publish, under A, found A's claim still queued and
        replaced it, and each copy then found the other's claim and was skipped as
        superseded: the job never ran. (And with `unique_for`, two runs that retried under
        two secrets were each throttled by the other's mark under its own key.)

        The claim that stops this copy (another publish's, where `supersede` or a started
        mark under `unique_for`), our marks taken back; else None."""
        spec = self.spec
        new = self.marked
        made = [spec.key]
        for key, _ in spec.previous:
            kept: str | None = yield SwapPublish(key, spec.task_id, new, spec.claim_ttl)
            if kept is None:
                made.append(key)
            elif spec.supersede or (spec.unique_for and kept.startswith(STARTED)):
                if new is not None:
                    for ours in made:  # owner-checked: only our own mark goes
                        yield SwapPublish(ours, new, None, spec.claim_ttl)
                return kept
            # else a queued claim of another publish there is left alone
        return None

    def superseded_copy(self, lease: Lease | None, holder: str) -> JobFlow[Outcome]:
        """A newer publish replaced this copy before it started: skip, acked, never run."""
        fence = None if lease is None else lease.fence
        yield Event(Kind.REPLACED, fence, holder.removeprefix(STARTED), reason="replaced")
        if lease is not None:
            yield from self.release_quietly(lease)
        return Outcome("superseded", SUPERSEDED, fence, holder=holder.removeprefix(STARTED))

    def throttle(self) -> JobFlow[None]:
        """unique_for: the claim, marked started, lasts that long after the run finished."""
        spec = self.spec
        mine = STARTED + spec.task_id
        try:
            for key in spec.claim_keys:
                yield SwapPublish(key, mine, mine, spec.unique_for)
        except BackendUnavailable as exc:  # the job is done; only the throttle is lost
            yield Event(Kind.THROTTLE_NOT_SET, detail=type(exc).__name__)
