"""The publish claim as I/O-free flows: which copy of a job goes out, what a duplicate gets."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from jobfence.locks.flows import Flow
from jobfence.locks.ops import ClaimPublish, ClearPublish, SwapPublish
from jobfence.tasks.errors import DuplicatePublish
from jobfence.tasks.lifecycle import STARTED
from jobfence.tasks.options import DuplicatePublishPolicy

#: Tries of a replace whose claim moved meanwhile (its holder started, or was replaced).
REPLACE_ATTEMPTS = 3


def ordered_id() -> str:
    """A task id that says when it was made: a UUID of version 7 (RFC 9562: 48 bits of Unix
    milliseconds, then random bits), so a publish claim naming it orders its publish against
    an outbox row sent late (`publish_flow`'s `written_at`)."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    value = value & ~(0xF << 76) | 0x7 << 76  # the version
    value = value & ~(0x3 << 62) | 0x2 << 62  # the variant (RFC 9562)
    return str(uuid.UUID(int=value))


def published_at(task_id: str) -> float | None:
    """When the task id `task_id` was made (Unix seconds), if it is an `ordered_id`; None for
    any other id (a caller's own, a version 4 UUID): its publish's time is unknown."""
    try:
        parsed = uuid.UUID(task_id)
    except ValueError:
        return None
    if parsed.version != 7 or parsed.variant != uuid.RFC_4122:
        return None
    return (parsed.int >> 80) / 1000.0


@dataclass(frozen=True)
class PublishDecision:
    """What the shell does with one publish.

    "claimed": publish under the claim this publish now holds (taken from the queued copy
    `previous`, if any); "unclaimed": publish without the claim (a workflow's duplicate meets
    the holder at the gate); "result": publish nothing, answer with the holder's AsyncResult.
    """

    action: Literal["claimed", "unclaimed", "result"]
    holder: str = ""  # unclaimed, result: the task id of the copy that has the job
    previous: str | None = None  # claimed: the queued copy replaced


def publish_flow(
    key: str,
    task_id: str,
    ttl: float,
    *,
    policy: DuplicatePublishPolicy,
    workflow: bool,
    name: str,
    replace_started: bool = False,
    written_at: float | None = None,
) -> Flow[PublishDecision]:
    """Claim `key` for `task_id`; a duplicate gets `policy` (DuplicatePublish for "raise").

    A duplicate carrying a workflow (a chain, link, link_error, chord or group) goes out
    unclaimed where "result" or "replace" would answer with the holder's AsyncResult: the
    workflow waits on this task id, not the holder's. `replace_started`: a started holder's
    claim is replaced too (debounce: its run ended the last burst; supersede: the newest
    publish takes the key from it; docs/how-to/debounce.md, supersede.md).

    `written_at`: an outbox row's time, sent after its commit (by the relay, maybe long
    after). A claim naming a publish made after the row (its `ordered_id` says when) is
    newer than this one and is never replaced by it: under `replace`, debounce or supersede
    the row's copy goes out unclaimed and gives way at the gate to the newer publish.
    """
    holder = ""
    for _ in range(REPLACE_ATTEMPTS):
        held: str | None = yield ClaimPublish(key, task_id, ttl)
        if held is None:
            return PublishDecision("claimed")
        holder, started = held.removeprefix(STARTED), held.startswith(STARTED)
        if holder == task_id:  # our own job, started: its retry or deferred copy
            return PublishDecision("claimed")
        if policy == "raise":
            raise DuplicatePublish(
                f"{name}: a copy of this job is already "
                f"{'running or finished' if started else 'queued'} as task {holder} "
                "(on_duplicate_publish='raise')",
                task_id=holder,
                key=key,
            )
        if policy != "replace" or (started and not replace_started):
            break  # a started copy is never replaced (two would run): its result answers
        made = published_at(holder)
        if written_at is not None and made is not None and made > written_at:
            break  # a late outbox row meets a newer publish: it does not replace that
        # Take the claim from the queued copy first: it skips when it finds it gone.
        if (yield SwapPublish(key, held, task_id, ttl)) is None:
            return PublishDecision("claimed", previous=holder)
        # The claim moved meanwhile (the holder started, or was replaced): look again.
    return PublishDecision("unclaimed" if workflow else "result", holder=holder)


def give_back_flow(key: str, task_id: str, ttl: float, *, previous: str | None) -> Flow[bool]:
    """After a failed publish under the claim: give the claim back to the queued copy it was
    taken from, or clear it (nothing was queued), so the next publish goes out. False if the
    claim moved meanwhile and could not be given back."""
    if previous is None:
        yield ClearPublish(key)
        return True
    kept: str | None = yield SwapPublish(key, task_id, previous, ttl)
    return kept is None
