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
        # The names, labels and methods main's metrics module gives rate limits.
        self.rate_limit_wait = Histogram(
            "jobfence_rate_limit_wait_seconds",
            "Time a call waited for a global rate limit to admit it",
            ["limit"],
            registry=r,
        )
        self.rate_limit_denials = Counter(
            "jobfence_rate_limit_denials_total",
            "Calls a global rate limit refused, by what the caller did then",
            ["limit", "action"],
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

    # `limit` is the rate limit's declared name (or its task's name), never its key.
    def rate_limit_waited(self, limit: str, seconds: float) -> None:
        """A call admitted by `limit` after waiting `seconds` (0 when admitted at once)."""
        self.rate_limit_wait.labels(limit).observe(max(0.0, seconds))

    def rate_limit_denied(self, limit: str, action: str = "retry") -> None:
        """A call `limit` refused; `action`: what the caller did (retry, skip, raise, ...)."""
        self.rate_limit_denials.labels(limit, action).inc()

    def observe_heartbeat(self, backend: str, seconds: float, _leases: int) -> None:
        self.heartbeat.labels(backend).observe(seconds)
