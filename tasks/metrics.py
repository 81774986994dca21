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
        self.leader = Gauge(
            "jobfence_leader", "1 while this process leads the election", ["election"], registry=r
        )
        self.leader_fence = Gauge(
            "jobfence_leader_fence", "Fence of this process's latest term", ["election"], registry=r
        )
        self.leader_terms = Counter(
            "jobfence_leader_terms_total", "Terms this process won", ["election"], registry=r
        )
        self.leadership_lost = Counter(
            "jobfence_leadership_lost_total",
            "Terms that ended by a lost lease (not a resignation)",
            ["election"],
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

    def observe_leadership(self, election: str, event: str, fence: int) -> None:
        """A `LeadershipObserver` (jobfence.locks.leader): "elected", "lost" or "resigned"."""
        if event == "elected":
            self.leadership_lost.labels(election)  # the series exists (at 0) from the first term
            self.leader_terms.labels(election).inc()
            self.leader_fence.labels(election).set(fence)
            self.leader.labels(election).set(1)
            return
        if event == "lost":
            self.leadership_lost.labels(election).inc()
        self.leader.labels(election).set(0)
