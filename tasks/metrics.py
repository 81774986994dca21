"""Prometheus metrics for jobfence, on a registry of its own (no global state)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class TaskSeries:
    """One task's series of the two metrics every job that runs touches, labelled once.

    `labels()` takes a lock and builds a tuple key on each call; a job that runs would
    pay that twice on its hot path for children that never change.
    """

    acquire_wait: Histogram  # the child for one task: observe(seconds)
    done: Counter  # the child for (task, "done"): inc()


class Metrics:
    """Acquire waits, conflicts, timeouts, lost leases, stale fences, replays, heartbeats."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.acquire_wait = Histogram(
            "jobfence_acquire_wait_seconds",
            "Time from first attempt to grant",
            ["task"],
            registry=r,
        )
        self.conflicts = Counter(
            "jobfence_conflicts_total",
            "Deliveries that found the job busy",
            ["task", "policy"],
            registry=r,
        )
        self.timeouts = Counter(
            "jobfence_acquire_timeouts_total", "Waits that gave up", ["task"], registry=r
        )
        self.lost_leases = Counter("jobfence_lost_leases_total", "Leases marked lost", registry=r)
        self.stale_fences = Counter(
            "jobfence_stale_fence_total",
            "Writes refused for a stale fencing token",
            ["task"],
            registry=r,
        )
        self.replays = Counter(
            "jobfence_idempotent_replays_total",
            "Deliveries answered from a stored result",
            ["task"],
            registry=r,
        )
        self.executions = Counter(
            "jobfence_executions_total", "Task bodies run", ["task", "outcome"], registry=r
        )
        self.heartbeat = Histogram(
            "jobfence_heartbeat_seconds",
            "Latency of one batched lease extension",
            ["backend"],
            registry=r,
        )
        # Named as main's metrics module names them (semaphore = the task's name, never a key).
        self.semaphore_held = Gauge(
            "jobfence_semaphore_slots_held",
            "Semaphore slots held by this worker's processes",
            ["semaphore"],
            registry=r,
        )
        self.semaphore_limit = Gauge(
            "jobfence_semaphore_limit", "Slots a semaphore allows fleet-wide", ["semaphore"],
            registry=r,
        )  # fmt: skip
        self.semaphore_wait = Histogram(
            "jobfence_semaphore_wait_seconds",
            "Time a job waited for a concurrency slot",
            ["semaphore"],
            registry=r,
        )
        self.semaphore_requeues = Counter(
            "jobfence_semaphore_requeues_total",
            "Jobs published again because no concurrency slot came free in time",
            ["semaphore"],
            registry=r,
        )
        self._series: dict[str, TaskSeries] = {}

    def task(self, name: str) -> TaskSeries:
        """`name`'s hot-path series, labelled on first use (a race labels twice, harmlessly)."""
        series = self._series.get(name)
        if series is None:
            series = self._series[name] = TaskSeries(
                acquire_wait=self.acquire_wait.labels(name),
                done=self.executions.labels(name, "done"),
            )
        return series

    def observe_heartbeat(self, backend: str, seconds: float, _leases: int) -> None:
        self.heartbeat.labels(backend).observe(seconds)

    # -- semaphores: `semaphore` is the task's name (or a declared name), never a key --------
    def semaphore_acquired(self, semaphore: str, limit: int | None = None) -> None:
        """One slot of `semaphore` taken by this process (and its fleet-wide limit, if known)."""
        self.semaphore_held.labels(semaphore).inc()
        if limit is not None:
            self.semaphore_limit.labels(semaphore).set(limit)

    def semaphore_released(self, semaphore: str) -> None:
        """One slot of `semaphore` given back (released, or its lease lost)."""
        self.semaphore_held.labels(semaphore).dec()

    def semaphore_waited(self, semaphore: str, seconds: float) -> None:
        """A slot of `semaphore` granted after waiting `seconds` (0 when free at once)."""
        self.semaphore_wait.labels(semaphore).observe(max(0.0, seconds))

    def semaphore_requeued(self, semaphore: str) -> None:
        """A job found no slot of `semaphore` in time and was published again."""
        self.semaphore_requeues.labels(semaphore).inc()
