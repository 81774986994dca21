"""Decisions made visible: one structured log line per decision, and the store's decision log.

The executor's shell buffers a delivery's decisions (`Note` ops) and hands them here once,
when the delivery ends: every line is logged (logger `jobfence.decisions`, `extra=` fields)
and the batch goes to the store's `DecisionLog` in one round trip. Nothing here holds an
argument, an owner token or a secret: the job key is `<task name>:<hmac>`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jobfence.locks.decisions import ROUTINE, Decision, DecisionLog
from jobfence.locks.outage import OUTAGE

log = logging.getLogger("jobfence.decisions")

_CONFLICT = {
    "skip": "skipped: a duplicate of {holder}{held} which held the key",
    "wait": "waited: {holder}{held} held the key",
    "retry": "retried later: {holder}{held} held the key",
    "raise": "refused (on_conflict='raise'): {holder}{held} held the key",
}
_PHRASES = {
    "started": "granted the lease{fence} and started the body",
    "done": "done: its DONE record stored{fence}",
    "failed": "failed: the body raised; FAILED record stored{fence}",
    "released": "released{fence} without a record",
    "replayed": "replayed: the job's DONE record{fence} answered; the body did not run again",
    "defer": "deferred: its own earlier delivery still held the key",
    "queued": "queued behind {holder}{held}, which held the key",
    "throttled": "skipped: {holder} ran the key within unique_for",
    "stale": "stale write refused: fence {f} < {newer} (a newer holder wrote first)",
    "lease_lost": "lease lost{fence} with no newer holder in sight",
    "redeliver": "redelivered: {reason}",
    "given_up": "given up: {reason}",
    "poisoned": "dead-lettered{fence}: too many deliveries lost their worker mid-body",
    "rate_limited": "rate limited{fence}: comes back at its turn",
    "rate_skipped": "skipped{fence}: no rate-limit turn free",
    "requeue": "requeued{fence}: no concurrency slot came free in time",
}


def describe(d: Decision, holder_fence: int | None = None) -> str:
    """`d` in plain words ("skipped: a duplicate of task abc (fence 41) which held the key");
    `holder_fence`: the holder's fence, where the log shows it."""
    holder = f"task {d.holder}" if d.holder else "another task"
    held = f" (fence {holder_fence})" if holder_fence is not None else ""
    if d.event == "conflict":
        text = _CONFLICT.get(d.reason, "conflict: {holder}{held} held the key")
    elif d.event == "superseded":
        text = ("superseded: a newer publish ({holder}) replaced it before it started"
                if d.reason == "replaced"
                else "superseded: a newer holder took the key over{fence}")  # fmt: skip
    else:
        text = _PHRASES.get(d.event, d.event + "{fence}")
    return text.format(
        holder=holder,
        held=held,
        fence=f" (fence {d.fence})" if d.fence is not None else "",
        f=d.fence if d.fence is not None else "?",
        newer=d.newer if d.newer is not None else "?",
        reason=d.reason or "unknown",
    )


class DecisionRecorder:
    """Logs each decision and stores a delivery's batch in the store's log (if it keeps one).

    A failure to store is a warning through the outage limiter, never the job's failure.
    """

    def __init__(self, store: DecisionLog | None) -> None:
        self.store = store

    def record(self, decisions: Sequence[Decision]) -> None:
        for d in decisions:
            level = logging.DEBUG if d.event in ROUTINE else logging.INFO
            if log.isEnabledFor(level):
                log.log(
                    level,
                    "%s[%s] key %s: %s",
                    d.task_name,
                    d.task_id,
                    d.key,
                    describe(d),
                    extra={
                        "decision": d.event,
                        "task_id": d.task_id,
                        "task_name": d.task_name,
                        "job_key": d.key,
                        "fence": d.fence,
                        "holder": d.holder,
                    },
                )
        if self.store is None or not decisions:
            return
        try:
            self.store.append_many(decisions)
        except Exception as exc:  # the log is for people: it never changes a job's fate
            OUTAGE.warning(log, "decision log not written (%d decisions): %s",
                           len(decisions), type(exc).__name__)  # fmt: skip
