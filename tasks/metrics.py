"""Prometheus metrics for jobfence, on a registry of its own (no global state)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram


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
        self.rate_limited = Counter(
            "jobfence_rate_limited_total",
            "Events a global rate limit held back, by what became of them",
            ["limiter", "action"],  # action: waited | retried | skipped | denied
            registry=r,
        )
        self.rate_wait = Histogram(
            "jobfence_rate_limit_wait_seconds",
            "Time an admitted event waited for its turn under a global rate limit",
            ["limiter"],
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

    def observe_rate_limit(self, limiter: str, action: str, wait: float = 0.0) -> None:
        """An event held back by the limiter `limiter` (a task or limiter name, never a key
        built from arguments); a wait it sat out is observed too."""
        self.rate_limited.labels(limiter, action).inc()
        if action == "waited":
            self.rate_wait.labels(limiter).observe(wait)

    def observe_heartbeat(self, backend: str, seconds: float, _leases: int) -> None:
        self.heartbeat.labels(backend).observe(seconds)
