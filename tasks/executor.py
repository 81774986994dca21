"""The lock-gated executor: look up DONE, acquire, run with the lease, commit DONE, release."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from jobfence.locks.acquire import Backoff
from jobfence.locks.backend import Busy, JobRecord, LockBackend, default_meta
from jobfence.locks.errors import AcquireTimeout, BackendUnavailable, LeaseLost, StaleFence
from jobfence.locks.keeper import LeaseKeeper
from jobfence.locks.lease import Lease
from jobfence.tasks.context import JobContext, reset_current, set_current
from jobfence.tasks.errors import DuplicateJob, IdempotencyConflict, PoisonMessage
from jobfence.tasks.keys import canonical_json
from jobfence.tasks.metrics import Metrics

log = logging.getLogger(__name__)

ConflictPolicy = Literal["skip", "wait", "retry", "raise"]
CONFLICT_POLICIES: tuple[str, ...] = ("skip", "wait", "retry", "raise")
Status = Literal["ran", "replayed", "duplicate", "superseded", "defer", "retry"]

Observer = Callable[[str, "JobSpec", int | None], None]  # event, job, fence

DUPLICATE = {"jobfence": "duplicate"}
SUPERSEDED = {"jobfence": "superseded"}


@dataclass(frozen=True)
class JobSpec:
    """One delivery of a job, as the executor needs it."""

    name: str
    key: str
    fingerprint: str
    ttl: float
    result_ttl: float
    task_id: str = ""
    on_conflict: ConflictPolicy = "skip"
    wait_timeout: float = 10.0
    # This delivery may follow one that died mid-body (broker redelivery, or our deferred
    # copy of one); such grants are counted per key, and past `max_crashed` the job is
    # recorded FAILED instead of run again (0: no cap).
    suspect: bool = False
    max_crashed: int = 0


@dataclass(frozen=True)
class Outcome:
    """What happened to one delivery. `countdown` is set for `defer` and `retry`."""

    status: Status
    value: Any = None
    fence: int | None = None
    countdown: float = 0.0


class Executor:
    """Runs job bodies under a lease. No Celery here: the task layer translates outcomes.

    Round trips on Redis for a job that runs: one `begin` (DONE check and grant),
    one `commit` (DONE record and release), plus the keeper's batched extensions.
    """

    def __init__(
        self,
        backend: LockBackend,
        keeper: LeaseKeeper,
        *,
        backoff: Backoff,
        metrics: Metrics | None = None,
    ) -> None:
        self.observers: list[Observer] = []  # told of every event: started, done, replayed...
        self.backend = backend
        self.keeper = keeper
        self.backoff = backoff
        self.metrics = metrics or Metrics()

    def run(
        self,
        spec: JobSpec,
        body: Callable[[JobContext], Any],
        *,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> Outcome:
        """Run `body` once for `spec.key`. Exceptions in `passthrough` release without a record."""
        got = self.begin(spec)
        if isinstance(got, Outcome):
            return got
        lease = got
        if spec.suspect and spec.max_crashed:
            self._cap_crashes(spec, lease)
        ctx = JobContext(
            key=spec.key, fingerprint=spec.fingerprint, lease=lease, task_id=spec.task_id
        )
        self.keeper.keep(lease)
        self._note("started", spec, lease.fence)
        token = set_current(ctx)
        try:
            value = body(ctx)
            # Inside the try: an unstorable result is a failure that must release the lease.
            result = canonical_json(value, what=f"the result of {spec.name}")
        except (StaleFence, LeaseLost) as exc:
            self._superseded(spec, lease, exc)
            return Outcome("superseded", SUPERSEDED, lease.fence)
        except passthrough:
            self.release(lease)
            self._note("released", spec, lease.fence)
            raise
        except BaseException as exc:
            self._finish(
                spec,
                lease,
                "FAILED",
                canonical_json({"error": type(exc).__name__, "message": str(exc)[:500]}),
            )
            self.metrics.executions.labels(spec.name, "failed").inc()
            self._note("failed", spec, lease.fence)
            raise
        finally:
            reset_current(token)
        self._finish(spec, lease, "DONE", result)
        self.metrics.executions.labels(spec.name, "done").inc()
        self._note("done", spec, lease.fence)
        return Outcome("ran", value, lease.fence)

    def begin(self, spec: JobSpec) -> Lease | Outcome:
        """Acquire the job's lease, or say why not (replay, duplicate, defer, retry)."""
        clock = self.backend.clock
        started = clock.monotonic()
        deadline = started + spec.wait_timeout
        meta = default_meta(task_id=spec.task_id, task_name=spec.name)
        attempt = 0
        while True:
            got = self.backend.begin(
                spec.key, spec.ttl, meta=meta, record=True, fingerprint=spec.fingerprint
            )
            if isinstance(got, Lease):
                self.metrics.acquire_wait.labels(spec.name).observe(clock.monotonic() - started)
                return got
            if isinstance(got, JobRecord):
                return self._replay(spec, got)
            if spec.task_id and got.task_id == spec.task_id:
                # Our own earlier delivery holds it (redelivered or crashed): come back when
                # its lease ends. Dropping this copy could lose the job if that holder died.
                self._note("defer", spec, None)
                return Outcome("defer", countdown=self._after(got, attempt))
            self.metrics.conflicts.labels(spec.name, spec.on_conflict).inc()
            self._note("conflict", spec, None)
            if spec.on_conflict == "skip":
                return Outcome("duplicate", DUPLICATE)
            if spec.on_conflict == "raise":
                raise DuplicateJob("job is running elsewhere", key=spec.key)
            if spec.on_conflict == "retry":
                return Outcome("retry", countdown=self._after(got, attempt))
            left = deadline - clock.monotonic()
            if left <= 0:
                self.metrics.timeouts.labels(spec.name).inc()
                raise AcquireTimeout(
                    f"job still running after {spec.wait_timeout:g}s", key=spec.key
                )
            self.backend.wait_for_release(
                spec.key, min(left, got.ttl_left + 0.001, max(self.backoff.delay(attempt), 0.001))
            )
            attempt += 1

    def release(self, lease: Lease) -> None:
        """Release without a record (a retry is on its way, or the body was interrupted)."""
        self.keeper.drop(lease)
        if not lease.released:
            lease.release()

    # -- helpers -------------------------------------------------------------------
    def _note(self, event: str, spec: JobSpec, fence: int | None) -> None:
        for observe in self.observers:
            try:
                observe(event, spec, fence)
            except Exception:  # an observer must never change the job's fate
                log.exception("executor observer failed on %s", event)

    def _after(self, busy: Busy, attempt: int) -> float:
        return min(busy.ttl_left, 3600.0) + self.backoff.delay(attempt)

    def _replay(self, spec: JobSpec, record: JobRecord) -> Outcome:
        if record.fingerprint != spec.fingerprint:
            raise IdempotencyConflict(
                "idempotency key reused with different arguments; use a new key or the "
                "original arguments",
                key=spec.key,
                fence=record.fence,
            )
        self.metrics.replays.labels(spec.name).inc()
        self._note("replayed", spec, record.fence)
        return Outcome(
            "replayed", json.loads(record.result) if record.result else None, record.fence
        )

    def _finish(self, spec: JobSpec, lease: Lease, state: str, result: str) -> None:
        self.keeper.drop(lease)
        if lease.released:
            return
        stored = self.backend.commit(
            lease,
            state=state,
            result=result,
            fingerprint=spec.fingerprint,
            result_ttl=spec.result_ttl,
        )
        if not stored:
            log.warning(
                "job %s finished after its lease was lost; %s record not stored (fence=%s)",
                spec.key,
                state,
                lease.fence,
            )

    def _cap_crashes(self, spec: JobSpec, lease: Lease) -> None:
        """Count a grant that follows a delivery which may have died; past the cap, give up.

        A message that kills its worker every time would otherwise loop for ever under
        acks_late + reject_on_worker_lost. Giving up records FAILED (so later copies replay
        it), logs one dead-letter line (task name and key, never the arguments) and raises.
        """
        try:
            count = self.backend.count_delivery(spec.key, spec.result_ttl)
        except BackendUnavailable:
            count = None  # best effort: running the body again is what no cap would do
        if count is None or count <= spec.max_crashed:
            return
        message = (
            f"gave up after {count - 1} deliveries that ended without a record (their worker "
            f"was lost mid-body); limit JOBFENCE_MAX_CRASHED_DELIVERIES={spec.max_crashed}"
        )
        failed = canonical_json({"error": PoisonMessage.__name__, "message": message})
        self._finish(spec, lease, "FAILED", failed)
        self.backend.reset_deliveries(spec.key)  # a resubmission starts with a fresh budget
        self.metrics.executions.labels(spec.name, "poisoned").inc()
        self._note("poisoned", spec, lease.fence)
        log.error(
            "dead-letter: task %s key %s recorded FAILED: %s", spec.name, spec.key, message
        )
        raise PoisonMessage(message, key=spec.key, fence=lease.fence)

    def _superseded(self, spec: JobSpec, lease: Lease, exc: BaseException) -> None:
        if isinstance(exc, StaleFence):
            self.metrics.stale_fences.labels(spec.name).inc()
        log.warning(
            "job %s superseded by a newer holder (fence=%s): %s",
            spec.key,
            lease.fence,
            type(exc).__name__,
        )
        self.metrics.executions.labels(spec.name, "superseded").inc()
        self._note("stale" if isinstance(exc, StaleFence) else "superseded", spec, lease.fence)
        self.release(lease)
