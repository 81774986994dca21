"""The test's lock server: `memory://` with a fault switch for `begin` and `commit`."""

from __future__ import annotations

import threading
from typing import Any, Literal

from jobfence.locks.backend import BeginResult
from jobfence.locks.backends.memory import MemoryBackend
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import Lease

FaultPoint = Literal["begin", "commit"]
FAULT_POINTS: tuple[str, ...] = ("begin", "commit")


class LockServerForTests(MemoryBackend):
    """`memory://` with a fault switch: `fail("begin"|"commit", times)` makes that operation
    raise BackendUnavailable, as a lock server that does not answer would.

    A commit failing for good (`times=None`) is an outage that outlasts the job's lease: the
    lease's time is run out at the first refused commit (its grant expires here, its deadline
    passes in the worker), so the executor gives the commit up as of unknown outcome and the
    job is delivered again, as it would be after the TTL, without waiting for it."""

    __test__ = False  # pytest: not a test class

    def __init__(self) -> None:
        super().__init__()
        self._faults: dict[str, int | None] = {}  # op -> failures left (None: until restored)
        self._faults_lock = threading.Lock()

    def fail(self, at: FaultPoint, times: int | None = 1) -> None:
        """The next `times` calls of `at` fail (None: every call until `restore`)."""
        if at not in FAULT_POINTS:
            raise ValueError(f"fail(at={at!r}): use one of {', '.join(FAULT_POINTS)}")
        if times is not None and times < 1:
            raise ValueError(f"fail(times={times!r}): use a count of 1 or more, or None")
        with self._faults_lock:
            self._faults[at] = times

    def restore(self) -> None:
        """The lock server answers again."""
        with self._faults_lock:
            self._faults.clear()

    def _fault(self, at: str) -> None:
        with self._faults_lock:
            if at not in self._faults:
                return
            left = self._faults[at]
            if left is not None:
                if left <= 1:
                    del self._faults[at]
                else:
                    self._faults[at] = left - 1
        raise BackendUnavailable(f"lock server unavailable at {at} (simulated by jobfence.testing)")

    def _run_out(self, lease: Lease) -> None:
        """`lease`'s time passes: its grant expires here and its deadline in the worker."""
        self.release_grant(lease.key, lease.fence)
        lease.deadline = min(lease.deadline, self.clock.monotonic())

    def begin(self, key: str, ttl: float, **options: Any) -> BeginResult:
        self._fault("begin")
        return super().begin(key, ttl, **options)

    def commit(
        self, lease: Lease, *, state: str, result: str, fingerprint: str, result_ttl: float
    ) -> bool:
        try:
            self._fault("commit")
        except BackendUnavailable:
            with self._faults_lock:
                for_good = self._faults.get("commit", 0) is None
            if for_good:
                self._run_out(lease)
            raise
        return super().commit(
            lease, state=state, result=result, fingerprint=fingerprint, result_ttl=result_ttl
        )
