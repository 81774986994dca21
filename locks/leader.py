"""Leader election for any singleton process: a term per grant of a lease, its fence and its end."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from jobfence.locks.backend import LockBackend, default_meta, validate_seconds
from jobfence.locks.drive import run_sync
from jobfence.locks.errors import AcquireTimeout, LeaseLost, LockError
from jobfence.locks.flows import Backoff, campaign_flow
from jobfence.locks.keeper import LeaseKeeper
from jobfence.locks.lease import Lease, OwnerMeta

log = logging.getLogger(__name__)

#: The lock key of election `name` (beat keeps its own key, "beat-leader").
LEADER_KEY_PREFIX = "leader:"
#: What `jobfence locks` shows as the holder's task name.
LEADER_TASK_NAME = "jobfence.leader"
#: After the lock server failed a campaign's attempt, the elector tries again after this
#: fraction of the TTL (at most MAX_RETRY_DELAY seconds).
RETRY_FRACTION = 1 / 3
MAX_RETRY_DELAY = 1.0

#: Told of every change of leadership: (lock key, "elected" | "lost" | "resigned", fence).
LeadershipObserver = Callable[[str, str, int], None]
TermCallback = Callable[["Term"], None]


def leader_key(name: str) -> str:
    """The lock key of the election `name`."""
    if not isinstance(name, str) or not name:
        raise LockError(f"an election needs a non-empty name, got {name!r}")
    return LEADER_KEY_PREFIX + name


class _EndEvent(threading.Event):
    """An Event that also looks at the lease's local deadline whenever it is read.

    The keeper sets it at the deadline, but a process that was frozen past its deadline
    may run its own thread first on waking: reading the event must not answer "still
    leading" then.
    """

    def __init__(self, term: Term) -> None:
        super().__init__()
        self._term = term

    def is_set(self) -> bool:
        if not super().is_set():
            self._term._poll()
        return super().is_set()

    isSet = is_set  # threading.Event's old alias

    def wait(self, timeout: float | None = None) -> bool:
        self._term._poll()
        if super().wait(timeout):
            return True
        self._term._poll()  # the deadline may have passed during the wait (a freeze in it)
        return super().is_set()


class Term:
    """One term of leadership: the lease that grants it, its fence, and an event for its end.

    `fence` is the lease's fencing token: strictly greater than every earlier term's of the
    same election, so the leader's writes carry it through a fence guard and a stale
    leader's writes are refused. `lost` is set once the term ends: the lease was lost (the
    server refused an extension, or its deadline passed before one was confirmed, say while
    the server was unreachable or this process was frozen) or the term was resigned. It is
    read against the local deadline too, so a process that wakes from a freeze sees it set
    before it writes. `cause` is the loss (None after a resignation).
    """

    def __init__(
        self,
        lease: Lease,
        keeper: LeaseKeeper,
        *,
        observer: LeadershipObserver | None = None,
    ) -> None:
        self.lease = lease
        self.key = lease.key
        self.fence = lease.fence
        self.cause: BaseException | None = None
        self._keeper = keeper
        self._observer = observer
        self._mutex = threading.Lock()
        self._ended = False
        self._listeners: list[Callable[[], None]] = []
        self.lost: threading.Event = _EndEvent(self)
        lease.on_lost(self._lease_lost)
        keeper.keep(lease)
        self._observe("elected")

    def __repr__(self) -> str:
        state = "leading" if not self._ended else "resigned" if self.cause is None else "lost"
        return f"Term(key={self.key!r}, fence={self.fence}, {state})"

    @property
    def leading(self) -> bool:
        """True until the term ends (reads the local deadline: cheap, no round trip)."""
        return not self.lost.is_set()

    def remaining(self) -> float:
        """Seconds until the lease's deadline, as the keeper last extended it."""
        return self.lease.remaining()

    def check(self) -> None:
        """Raise LeaseLost once the term has ended; cheap enough to call in a loop."""
        if self.lost.is_set():
            reason = "leadership lost" if self.cause is not None else "the term was resigned"
            raise LeaseLost(reason, key=self.key, fence=self.fence, cause=self.cause)

    def resign(self) -> bool:
        """End the term and release the lease at once (owner-checked), so a standby takes
        over without waiting out the TTL. True if the lease was still ours to release."""
        self._end(None)
        self._keeper.drop(self.lease)
        try:
            return self.lease.release()
        except LockError as exc:  # unreachable: the lease runs out by itself
            log.warning("leader %s: could not release the lease: %s", self.key, exc)
            return False

    def on_end(self, listener: Callable[[], None]) -> None:
        """Call `listener()` once the term ends (at once if it has). It runs in the thread
        that noticed the end, possibly the keeper's, so it must only wake someone up."""
        with self._mutex:
            if not self._ended:
                self._listeners.append(listener)
                return
        listener()

    def watch(self, on_lost: TermCallback) -> threading.Thread:
        """Call `on_lost(term)` from a thread of its own if the term is lost (not if it is
        resigned): a slow callback never holds up the keeper."""

        def run() -> None:
            self.lost.wait()
            if self.cause is not None:
                _call(on_lost, self, "on_lost")

        thread = threading.Thread(target=run, name=f"jobfence-leader:{self.key}", daemon=True)
        thread.start()
        return thread

    # -- the end of the term -----------------------------------------------------
    def _poll(self) -> None:
        if not self._ended and self.lease.lost:
            try:
                self.lease.check()
            except LeaseLost as exc:
                self._end(exc)

    def _lease_lost(self, _lease: Lease, cause: BaseException) -> None:
        self._end(cause)  # in the keeper's thread, under its mutex: wake-ups only

    def _end(self, cause: BaseException | None) -> None:
        with self._mutex:
            if self._ended:
                return
            self._ended = True
            self.cause = cause
            listeners, self._listeners = self._listeners, []
        threading.Event.set(self.lost)
        if cause is not None:
            log.warning(
                "leader %s: leadership lost (fence %d): %s", self.key, self.fence,
                type(cause).__name__,
            )  # fmt: skip
        self._observe("lost" if cause is not None else "resigned")
        for listener in listeners:
            listener()

    def _observe(self, event: str) -> None:
        if self._observer is not None:
            try:
                self._observer(self.key, event, self.fence)
            except Exception:  # metrics must never change who leads
                log.exception("leadership observer failed")


def try_elect(
    backend: LockBackend,
    keeper: LeaseKeeper,
    key: str,
    *,
    ttl: float,
    meta: OwnerMeta | None = None,
    observer: LeadershipObserver | None = None,
) -> Term | None:
    """One attempt: a Term if this process now leads `key`, None if another one does."""
    lease = backend.try_acquire(key, ttl, meta=meta or default_meta(task_name=LEADER_TASK_NAME))
    return None if lease is None else Term(lease, keeper, observer=observer)


def elect(
    backend: LockBackend,
    keeper: LeaseKeeper,
    key: str,
    *,
    ttl: float,
    timeout: float | None = None,
    backoff: Backoff | None = None,
    meta: OwnerMeta | None = None,
    observer: LeadershipObserver | None = None,
    cancel: threading.Event | None = None,
) -> Term:
    """Wait until this process leads `key` (up to `timeout` seconds; None: for ever).

    A standby wakes on the leader's release where the backend signals it, and otherwise
    within one backoff step of the leader's lease running out. Raises AcquireTimeout at the
    timeout or once `cancel` is set, and LockError if the lock server fails an attempt.
    """
    flow = campaign_flow(
        key,
        ttl=ttl,
        timeout=timeout,
        backoff=backoff,
        meta=meta or default_meta(task_name=LEADER_TASK_NAME),
        cancelled=None if cancel is None else cancel.is_set,
    )
    return Term(run_sync(flow, backend, backend.clock), keeper, observer=observer)


class LeaderElector:
    """Campaigns for `key` on a thread of its own until `stop()`: waits to be elected, calls
    `on_elected(term)`, and when the term is lost calls `on_lost(term)`, releases, and
    campaigns again (a new term, a higher fence). `stop()` resigns at once.

    The callbacks run on the elector's thread; `on_elected` should hand the work to another
    thread (or return quickly) and that work should watch `term.lost` or call
    `term.check()`. A lock server that fails an attempt is retried after a short delay.
    """

    def __init__(
        self,
        backend: LockBackend,
        keeper: LeaseKeeper,
        key: str,
        *,
        ttl: float,
        on_elected: TermCallback | None = None,
        on_lost: TermCallback | None = None,
        backoff: Backoff | None = None,
        meta: OwnerMeta | None = None,
        observer: LeadershipObserver | None = None,
    ) -> None:
        self.backend = backend
        self.keeper = keeper
        self.key = key
        self.ttl = validate_seconds(ttl, "ttl", positive=True)
        self.on_elected = on_elected
        self.on_lost = on_lost
        self.backoff = backoff
        self.meta = meta
        self.observer = observer
        self.retry_delay = min(ttl * RETRY_FRACTION, MAX_RETRY_DELAY)
        self.terms = 0  # terms won so far
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._term: Term | None = None
        self._wake: threading.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def term(self) -> Term | None:
        """The current term while this process leads, else None."""
        term = self._term
        return term if term is not None and term.leading else None

    @property
    def is_leader(self) -> bool:
        return self.term is not None

    def start(self) -> LeaderElector:
        if self._thread is not None:
            raise LockError("this elector was started already; build another", key=self.key)
        self._thread = threading.Thread(
            target=self._run, name=f"jobfence-elector:{self.key}", daemon=True
        )
        self._thread.start()
        return self

    def wait_elected(self, timeout: float | None = None) -> Term | None:
        """Block until this process leads (the current term), or None after `timeout`."""
        with self._cond:
            self._cond.wait_for(lambda: self.term is not None or self._stop.is_set(), timeout)
            return self.term

    def stop(self, timeout: float = 10.0) -> None:
        """Stop campaigning; a leading term is resigned, so a standby takes over at once."""
        self._stop.set()
        wake = self._wake
        if wake is not None:
            wake.set()
        with self._cond:
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> LeaderElector:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- the elector's thread ----------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                term = self._campaign()
                if term is not None:
                    self._serve(term)
            except Exception:  # never die silently: a campaign that stopped would never lead
                log.exception("leader %s: elector failed; campaigning again", self.key)
                self._stop.wait(self.retry_delay)
        with self._cond:
            self._cond.notify_all()

    def _campaign(self) -> Term | None:
        try:
            return elect(
                self.backend, self.keeper, self.key, ttl=self.ttl, backoff=self.backoff,
                meta=self.meta, observer=self.observer, cancel=self._stop,
            )  # fmt: skip
        except AcquireTimeout:
            return None  # cancelled by stop()
        except LockError as exc:
            log.warning("leader %s: campaign attempt failed, retrying: %s", self.key, exc)
            self._stop.wait(self.retry_delay)
            return None

    def _serve(self, term: Term) -> None:
        """Lead until the term ends or the elector stops; then step down."""
        wake = threading.Event()
        self._wake = wake
        term.on_end(wake.set)
        if self._stop.is_set():
            wake.set()
        self.terms += 1
        with self._cond:
            self._term = term
            self._cond.notify_all()
        try:
            start = self.on_elected
            if start is not None and not wake.is_set() and not _call(start, term, "on_elected"):
                term.resign()  # a leader that cannot start its work should not lead,
                self._stop.wait(self.retry_delay)  # and lets a standby try first
            while not wake.is_set():
                # Bounded by the deadline: the term is read again there even if the keeper
                # is late.
                wake.wait(max(0.001, min(term.remaining(), 1.0)))
                term._poll()
            if term.cause is not None and self.on_lost is not None:
                _call(self.on_lost, term, "on_lost")
        finally:
            term.resign()  # owner-checked: frees the key at once if it is in fact still ours
            with self._cond:
                self._term = None
                self._cond.notify_all()


def _call(callback: TermCallback, term: Term, what: str) -> bool:
    try:
        callback(term)
    except Exception:
        log.exception("leader %s: %s callback failed", term.key, what)
        return False
    return True
