"""The outbox relay: one worker of the fleet, elected, sends what was committed and never sent."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from celery import bootsteps
from kombu.exceptions import OperationalError

from jobfence.locks.keeper import LeaseKeeper
from jobfence.locks.leader import LeaderElector, Term, leader_key
from jobfence.tasks.runtime import Runtime, installed

log = logging.getLogger(__name__)

#: The election the relays of one fleet (one key prefix) campaign in.
ELECTION = "outbox-relay"
#: Rows sent per look; the next look follows at once while a look finds a full batch.
BATCH = 200
#: The relay's leader term, in seconds: a relay that dies hands over within this long.
TERM_TTL = 10.0
#: A publish failing so says the broker is away: the rest of the look would fail alike.
BROKER_DOWN: tuple[type[BaseException], ...] = (
    OSError, OperationalError, TimeoutError, redis.ConnectionError, redis.TimeoutError,
)  # fmt: skip


class OutboxRelay:
    """Publishes the outbox's committed, unsent rows once they are older than `grace`, while
    this process leads the election; prunes sent rows older than `retention`.

    A publish that fails (the broker down) leaves its row unsent, counted in `attempts`, and
    ends the look: the next look, `poll` seconds later, tries again. No row is dropped.
    """

    def __init__(self, app: Any, runtime: Runtime, outbox: Any, *, grace: float, poll: float,
                 retention: float, ttl: float = TERM_TTL) -> None:  # fmt: skip
        self.app = app
        self.outbox = outbox
        self.grace = grace
        self.poll = poll
        self.retention = retention
        self.keeper = LeaseKeeper()
        self.elector = LeaderElector(runtime.backend, self.keeper, leader_key(ELECTION), ttl=ttl)
        self.sent = 0  # rows this relay sent (for tests and logs)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._pruned_at = 0.0

    def relay_once(self, term: Term | None = None) -> int:
        """One look: send the due rows (while `term` leads, if given); how many were sent."""
        from jobfence.tasks.outbox import publish_entry

        sent = 0
        for entry in self.outbox.due(time.time() - self.grace, BATCH):
            if term is not None and not term.leading:
                break
            try:
                publish_entry(self.app, entry)
            except BROKER_DOWN as exc:  # the next rows would fail alike: the next look
                log.warning("outbox relay: task %s not sent (%s); tried again in %gs",
                            entry.task_id, type(exc).__name__, self.poll)  # fmt: skip
                self.outbox.note_failure(entry.task_id)
                break
            except Exception as exc:  # this row's own fault: it must not hold up the rest
                log.error("outbox relay: task %s (%s) could not be sent (%s); left unsent, "
                          "counted in attempts", entry.task_id, entry.task_name,
                          type(exc).__name__)  # fmt: skip
                self.outbox.note_failure(entry.task_id)
                continue
            self.outbox.mark_sent(entry.task_id)
            sent += 1
        self.sent += sent
        if sent:
            log.info("outbox relay: sent %d committed message(s) no one had sent", sent)
        now = time.time()
        if now - self._pruned_at >= min(self.retention, 60.0):
            self._pruned_at = now
            self.outbox.prune(now - self.retention)
        return sent

    def start(self) -> OutboxRelay:
        self.keeper.start()
        self.elector.start()
        self._thread = threading.Thread(target=self._run, name="jobfence-outbox-relay",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.elector.stop(timeout)
        self.keeper.stop()

    def _run(self) -> None:
        while not self._stopping.is_set():
            term = self.elector.term
            full = False
            if term is not None:
                try:
                    full = self.relay_once(term) >= BATCH
                except Exception as exc:  # the database away: the next look tries again
                    log.warning("outbox relay: look failed (%s)", type(exc).__name__)
            if not full:
                self._stopping.wait(self.poll)


def build(app: Any) -> OutboxRelay | None:
    """The relay of this worker, or None: no jobfence runtime, or JOBFENCE_OUTBOX_URL unset."""
    runtime = installed(app)
    if runtime is None or not runtime.settings.outbox_url:
        return None
    from jobfence.tasks.effects import make_engine
    from jobfence.tasks.outbox import SqlOutbox

    s = runtime.settings
    assert s.outbox_url is not None
    return OutboxRelay(app, runtime, SqlOutbox(make_engine(s.outbox_url)), grace=s.outbox_grace,
                       poll=s.outbox_poll, retention=s.outbox_retention)  # fmt: skip


class OutboxRelayStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: this worker's outbox relay, campaigning for the fleet's one term."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self._relay: OutboxRelay | None = None

    def start(self, c: Any) -> None:
        self._relay = build(c.app)
        if self._relay is not None:
            self._relay.start()

    def stop(self, c: Any) -> None:
        if self._relay is not None:
            self._relay.stop()
            self._relay = None

    shutdown = stop


def connect(app: Any) -> None:
    """Add the relay's bootstep to `app`'s workers (it starts only where the URL is set)."""
    app.steps["consumer"].add(OutboxRelayStep)
