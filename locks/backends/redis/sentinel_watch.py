"""The watch on a Sentinel-managed master: which node the sentinels name, asked every
MASTER_POLL seconds, and what follows a change (see redis/sentinel.py for why)."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING

from redis.sentinel import MasterNotFoundError

from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import Lease
from jobfence.locks.outage import OUTAGE

if TYPE_CHECKING:  # only types: that module imports this one
    from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend

log = logging.getLogger(__name__)

#: How often the watch asks the sentinels which node is the master (seconds), and how old
#: its answer may be when a script is sent: an older one is asked again first, in the caller.
MASTER_POLL = 0.25
MASTER_MAX_AGE = 1.0


class MasterWatch:
    """Which node the sentinels name as master, asked every MASTER_POLL seconds by a thread
    that holds it only weakly; `epoch` counts the changes seen. On a change it points the
    pool at the new master (dropping the idle connections to the old), then has the backend
    confirm its live leases there."""

    def __init__(self, backend: RedisSentinelBackend) -> None:
        self._backend = weakref.ref(backend)
        self.address: tuple[str, int] | None = None
        self.epoch = 0
        self.config_epoch = -1  # the sentinels' own epoch of the answer taken
        self._reset()

    def _reset(self) -> None:
        """Fresh primitives, no thread and no leases (the parent's are not the child's):
        at start, and in a forked child."""
        self.leases: weakref.WeakSet[Lease] = weakref.WeakSet()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.checked_at = float("-inf")

    def stale(self) -> bool:
        """Whether a call now must ask the sentinels first (or start the thread)."""
        backend = self._backend()
        return (backend is None or self._thread is None or self._pid != os.getpid()
                or backend.clock.monotonic() - self.checked_at > MASTER_MAX_AGE)  # fmt: skip

    def epoch_now(self) -> int:
        """The epoch to send a call under: the sentinels asked again first if the last
        answer is older than MASTER_MAX_AGE (MasterNotFoundError if none answers)."""
        backend = self._backend()
        if backend is None or not self.stale():
            return self.epoch
        if self._pid != os.getpid():
            self._reset()
        if self._thread is None:
            self._start()
        if backend.clock.monotonic() - self.checked_at > MASTER_MAX_AGE:
            self.poll()
        return self.epoch

    def confirm(self, epoch: int, name: str, key: str | None) -> None:
        """Raise if the master changed while a call sent under `epoch` was in flight: it
        may have run on the old master, whose writes the new one never sees."""
        if self.epoch != epoch:
            raise BackendUnavailable(
                f"redis {name} failed: the sentinels named a new master during the call",
                key=key,
            )

    def master(self) -> tuple[str, int]:
        """The master's address as last answered (asked now if stale): what the pool's
        connections connect to."""
        if self.address is None or self.stale():
            self.epoch_now()
        if self.address is None:
            raise MasterNotFoundError("No master found: the sentinels named none")
        return self.address

    def poll(self) -> None:
        """Ask the sentinels now; on a change, follow it (see the class)."""
        backend = self._backend()
        if backend is None:
            return
        asked = backend.clock.monotonic()
        found = backend.discover()
        with self._lock:
            self.checked_at = max(self.checked_at, asked)
            if found[1] == self.address or found[0] < self.config_epoch:
                # The same, or an answer from sentinels not yet told of a failover.
                self.config_epoch = max(self.config_epoch, found[0])
                return
            moved, (self.config_epoch, self.address) = self.address is not None, found
        # Before the epoch moves, the pool drops its idle connections to the old master
        # (busy ones as they come back): a call that reads the new epoch meets none.
        backend.client.connection_pool.get_master_address()  # type: ignore[attr-defined]
        if not moved:
            # The first answer is no change: nothing was sent under an epoch before it. (It
            # once moved the epoch, and a call sent under the caller's first poll failed when
            # the watch thread's own first poll, answered at the same time, moved it again.)
            return
        with self._lock:
            self.epoch += 1
            leases = [le for le in list(self.leases) if not le.settled]
        log.warning("the sentinels name a new master for %s; confirming %d lease(s) on it",
                    backend.service, len(leases))  # fmt: skip
        backend.confirm_on_new_master(leases)

    def register(self, lease: Lease, epoch: int) -> None:
        """Keep `lease` (granted under `epoch`) for the confirmation at the next change;
        raise if a change came between its grant and now (then it was not confirmed)."""
        with self._lock:
            if epoch != self.epoch:
                raise BackendUnavailable(
                    "redis begin failed: the sentinels named a new master during the grant",
                    key=lease.key,
                    fence=lease.fence,
                )
            self.leases.add(lease)

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=_watch_loop, args=(weakref.ref(self),
                                            self._stop), name="jobfence-sentinel-watch",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)


def _watch_loop(ref: weakref.ref[MasterWatch], stop: threading.Event) -> None:
    while not stop.wait(MASTER_POLL):
        watch = ref()
        if watch is None:
            return
        try:
            watch.poll()
        except Exception as exc:  # no answer: the callers ask again themselves, and fail
            OUTAGE.warning(log, "asking the sentinels for the master failed: %s",
                           type(exc).__name__)  # fmt: skip
        del watch
