"""Decisions made visible: one structured log line per decision, and the store's decision log.

The `Decisions` middleware (tasks/middleware.py) buffers a delivery's decisions and hands
them here once, when the delivery ends: every line is logged at once (logger
`jobfence.decisions`, `extra=` fields; their words from tasks/events.py's table), and the
decisions go to the store's `DecisionLog` from a writer thread that sends
what every delivery of the process decided meanwhile in one round trip (at most every
FLUSH_INTERVAL seconds, or sooner past FLUSH_BATCH), so the log costs a job no round trip of
its own. Nothing here holds an argument, an owner token or a secret: the job key is
`<task name>:<hmac>`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Sequence

from jobfence.locks.decisions import ROUTINE, Decision, DecisionLog
from jobfence.locks.outage import OUTAGE
from jobfence.tasks.events import CONFLICT_PHRASES, FAILED_UNSTORED_PHRASE, PHRASES, REPLACED_PHRASE

log = logging.getLogger("jobfence.decisions")

def describe(d: Decision, holder_fence: int | None = None) -> str:
    """`d` in plain words ("skipped: a duplicate of task abc (fence 41) which held the key");
    `holder_fence`: the holder's fence, where the log shows it."""
    holder = f"task {d.holder}" if d.holder else "another task"
    held = f" (fence {holder_fence})" if holder_fence is not None else ""
    if d.event == "conflict":
        text = CONFLICT_PHRASES.get(d.reason, PHRASES["conflict"])
    elif d.event == "superseded" and d.reason == "replaced":
        text = REPLACED_PHRASE
    elif d.event == "failed" and d.reason:  # the FAILED record was not stored, or unknown
        text = FAILED_UNSTORED_PHRASE
    else:
        text = PHRASES.get(d.event, d.event + "{fence}")
    return text.format(
        holder=holder,
        held=held,
        fence=f" (fence {d.fence})" if d.fence is not None else "",
        f=d.fence if d.fence is not None else "?",
        newer=d.newer if d.newer is not None else "?",
        reason=d.reason or "unknown",
    )


FLUSH_INTERVAL = 0.2  # seconds a decision may wait in this process before it is stored
FLUSH_BATCH = 500  # decisions that make the writer store at once
PENDING_CAP = 20_000  # decisions held while the store does not answer; older ones dropped


class DecisionRecorder:
    """Logs each decision and stores the deliveries' decisions in the store's log (if it
    keeps one), batched across deliveries by a writer thread of this process.

    A failure to store is a warning through the outage limiter, never the job's failure;
    `flush()` stores what is pending now (tests, shutdown; also at interpreter exit).
    """

    def __init__(self, store: DecisionLog | None) -> None:
        self.store = store
        self._reset()
        if store is not None:
            atexit.register(self.flush)
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (r := ref()) and r._reset())  # type: ignore[func-returns-value]

    def _reset(self) -> None:
        # After fork the parent's writer is gone, and may have held `_write` (a batch in flight
        # on a stalled server) or `_cond`: the child's writer and close() would wait for ever.
        # The parent's pending decisions are the parent's to store.
        self._pending: list[Decision] = []
        self._cond = threading.Condition()
        self._write = threading.Lock()  # one batch stored at a time: flush waits for the writer's
        self._writer: threading.Thread | None = None
        self._pid = 0
        self._closed = False

    def flush(self) -> None:
        """Store every decision handed over so far (in this thread, after the writer's batch
        in flight); a store that fails is a warning, never raised."""
        with self._write:
            with self._cond:
                batch, self._pending = self._pending, []
            self._store(batch)

    def close(self) -> None:
        """Flush, and end the writer thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.flush()

    def _enqueue(self, decisions: Sequence[Decision]) -> None:
        cond = self._cond
        cond.acquire()  # the lock's own C methods: `with` adds the Condition's Python layer
        try:
            if self._writer is None:  # none yet, or forked (the child's _reset forgot it)
                self._pid, self._closed = os.getpid(), False
                self._pending = []  # a forked child's copy of the parent's queue: not ours
                self._writer = threading.Thread(target=self._run, name="jobfence-decisions",
                                                 daemon=True)  # fmt: skip
                self._writer.start()
            pending = self._pending
            pending.extend(decisions)
            if len(pending) > PENDING_CAP:
                del pending[: len(pending) - PENDING_CAP]
            if len(pending) >= FLUSH_BATCH:
                cond.notify()
        finally:
            cond.release()

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self._cond:
                if not self._closed and len(self._pending) < FLUSH_BATCH:
                    self._cond.wait(FLUSH_INTERVAL)
                if self._pid != pid:
                    return  # a later fork's writer took over in its own process
                closed = self._closed
            with self._write:  # the batch taken and stored under it: a flush sees it stored
                with self._cond:
                    batch, self._pending = self._pending, []
                self._store(batch)
            if closed:
                return

    def _store(self, batch: list[Decision]) -> None:
        if not batch or self.store is None:
            return
        try:
            self.store.append_many(batch)
        except Exception as exc:  # the log is for people: it never changes a job's fate
            OUTAGE.warning(log, "decision log not written (%d decisions): %s",
                           len(batch), type(exc).__name__)  # fmt: skip

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
        self._enqueue(decisions)
