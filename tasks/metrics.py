"""Prometheus metrics for jobfence, on a registry of its own (no global state).

Every label is low-cardinality: a task name, a backend name, an outcome or policy, or a
semaphore's or rate limit's declared name. Keys, task arguments and owner tokens never
become labels (they would leak data and grow a series per job).

Gauges name their multiprocess mode: under Celery's prefork pool (`worker/metrics_server.py`
switches prometheus_client to multiprocess mode before the pool forks) each pool process
writes its own values and the worker's /metrics endpoint sums them.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger(__name__)

#: Acquire and rate-limit waits: from "granted at once" to the longest sensible wait.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: One batched lease extension: a round trip to the lock server.
HEARTBEAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
#: Distinct semaphore or rate-limit names one metric takes before the rest count as OTHER.
MAX_NAMES = 200
OTHER = "_other"
NAME_LIMIT = 120  # characters of a declared name kept in a label


@dataclass(frozen=True)
class TaskSeries:
    """One task's series of the two metrics every job that runs touches, labelled once.

    `labels()` takes a lock and builds a tuple key on each call; a job that runs would
    pay that twice on its hot path for children that never change.
    """

    acquire_wait: Histogram  # the child for one task: observe(seconds)
    done: Counter  # the child for (task, "done"): inc()


class _Names:
    """The declared names one metric has seen; past MAX_NAMES a new one is reported as OTHER.

    A semaphore or limit named after its key (an account id, say) would otherwise grow a
    series per value: the cap bounds the damage and the warning names the metric to fix.
    """

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.warned = False

    def __call__(self, name: str) -> str:
        name = str(name)[:NAME_LIMIT]
        if name in self.seen:
            return name
        with self.lock:
            if len(self.seen) < MAX_NAMES:
                self.seen.add(name)
                return name
            if not self.warned:
                self.warned = True
                log.warning(
                    "%s has %d distinct names; further ones are counted as %r. Name "
                    "semaphores and rate limits by what they guard (a task or a declared "
                    "name), never by a key or an argument",
                    self.metric, MAX_NAMES, OTHER,
                )  # fmt: skip
            return OTHER


class MetricRow(NamedTuple):
    """One metric `Metrics` builds: its attribute, kind, series name, help and labels."""

    attribute: str
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # a histogram's
    mode: str = ""  # a gauge's multiprocess mode


#: Every metric `Metrics` builds, in registry order: a table, read by `_build`, `rebuild()`
#: and the after-fork locks. Each attribute is annotated on `Metrics` for type checkers.
METRIC_TABLE: tuple[MetricRow, ...] = (
    MetricRow("acquire_wait", Histogram, "jobfence_acquire_wait_seconds",
              "Time from first attempt to grant", ("task",), buckets=WAIT_BUCKETS),
    MetricRow("conflicts", Counter, "jobfence_conflicts_total",
              "Deliveries that found the job busy", ("task", "policy")),
    MetricRow("timeouts", Counter, "jobfence_acquire_timeouts_total", "Waits that gave up",
              ("task",)),
    MetricRow("lost_leases", Counter, "jobfence_lost_leases_total", "Leases marked lost"),
    MetricRow("stale_fences", Counter, "jobfence_stale_fence_total",
              "Writes refused for a stale fencing token", ("task",)),
    MetricRow("replays", Counter, "jobfence_idempotent_replays_total",
              "Deliveries answered from a stored result", ("task",)),
    MetricRow("executions", Counter, "jobfence_executions_total", "Task bodies run",
              ("task", "outcome")),
    MetricRow("heartbeat", Histogram, "jobfence_heartbeat_seconds",
              "Latency of one batched lease extension", ("backend",), buckets=HEARTBEAT_BUCKETS),
    # livesum: a pool process that exits takes its slots with it (their leases end too).
    MetricRow("semaphore_held", Gauge, "jobfence_semaphore_slots_held",
              "Semaphore slots held by this worker's processes", ("semaphore",), mode="livesum"),
    MetricRow("semaphore_limit", Gauge, "jobfence_semaphore_limit",
              "Slots a semaphore allows fleet-wide", ("semaphore",), mode="livemax"),
    MetricRow("rate_limit_wait", Histogram, "jobfence_rate_limit_wait_seconds",
              "Time a call waited for a global rate limit to admit it", ("limit",),
              buckets=WAIT_BUCKETS),
    MetricRow("rate_limit_denials", Counter, "jobfence_rate_limit_denials_total",
              "Calls a global rate limit refused, by what the caller did then",
              ("limit", "action")),
    MetricRow("semaphore_wait", Histogram, "jobfence_semaphore_wait_seconds",
              "Time a job waited for a concurrency slot", ("semaphore",), buckets=WAIT_BUCKETS),
    MetricRow("semaphore_requeues", Counter, "jobfence_semaphore_requeues_total",
              "Jobs published again because no concurrency slot came free in time",
              ("semaphore",)),
    MetricRow("leader", Gauge, "jobfence_leader", "1 while this process leads the election",
              ("election",), mode="livemax"),
    MetricRow("leader_fence", Gauge, "jobfence_leader_fence",
              "Fence of this process's latest term", ("election",), mode="max"),
    MetricRow("leader_terms", Counter, "jobfence_leader_terms_total",
              "Terms this process won", ("election",)),
    MetricRow("leadership_lost", Counter, "jobfence_leadership_lost_total",
              "Terms that ended by a lost lease (not a resignation)", ("election",)),
)  # fmt: skip
_RLOCK = type(threading.RLock())


def _fresh_lock(obj: object) -> None:
    """Give `obj` a new lock of the kind it holds in `_lock` (prometheus_client's mutexes)."""
    old = getattr(obj, "_lock", None)
    if old is not None and hasattr(old, "acquire"):
        obj._lock = threading.RLock() if isinstance(old, _RLOCK) else threading.Lock()  # type: ignore[attr-defined]


class Metrics:
    """Acquire waits, conflicts, timeouts, lost leases, stale fences, replays, heartbeats,
    runs by outcome, semaphore slots held, rate-limit waits and denials.

    Record through the attributes (`metrics.conflicts.labels(task, policy).inc()`) or the
    named methods below; read with `metrics.registry` (this process's values only: a
    prefork worker's /metrics endpoint aggregates every pool process).
    """

    acquire_wait: Histogram
    conflicts: Counter
    timeouts: Counter
    lost_leases: Counter
    stale_fences: Counter
    replays: Counter
    executions: Counter
    heartbeat: Histogram
    semaphore_held: Gauge
    semaphore_limit: Gauge
    rate_limit_wait: Histogram
    rate_limit_denials: Counter
    semaphore_wait: Histogram
    semaphore_requeues: Counter
    leader: Gauge
    leader_fence: Gauge
    leader_terms: Counter
    leadership_lost: Counter

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._build()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (m := ref()) and m._forked())  # type: ignore[func-returns-value]

    def _build(self) -> None:
        for row in METRIC_TABLE:
            extra = ({"buckets": row.buckets} if row.buckets
                     else {"multiprocess_mode": row.mode} if row.mode else {})  # fmt: skip
            metric = row.kind(row.name, row.doc, row.labels, registry=self.registry, **extra)
            setattr(self, row.attribute, metric)
        self._series: dict[str, TaskSeries] = {}
        self._semaphores = _Names("jobfence_semaphore_slots_held")
        self._limits = _Names("jobfence_rate_limit_*")

    def rebuild(self) -> None:
        """Re-create every metric (zeroed) on the same registry.

        prometheus_client picks each value's storage when the metric is built: after the
        exporter switches to multiprocess mode, the metrics built before must be built
        again. Holders of `Metrics` keep working; holders of a metric object do not.
        """
        for row in METRIC_TABLE:
            self.registry.unregister(getattr(self, row.attribute))
        self._build()

    def _forked(self) -> None:
        """New locks in a forked child, where no thread of the parent lives to release one it
        held at the fork (the keeper observing a heartbeat, a scrape of the registry): the
        child's first use of that series would wait for ever. The values stay as they were."""
        for names in (self._semaphores, self._limits):
            names.lock = threading.Lock()
        _fresh_lock(self.registry)
        for row in METRIC_TABLE:
            metric = getattr(self, row.attribute)
            for series in (metric, *getattr(metric, "_metrics", {}).values()):
                _fresh_lock(series)
                for value in vars(series).values():  # a counter's value, a histogram's buckets
                    for one in value if isinstance(value, list) else (value,):
                        _fresh_lock(one)

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

    # -- semaphores ------------------------------------------------------------------
    # `semaphore` is the semaphore's declared name (or its task's name), never its key.

    def semaphore_acquired(self, semaphore: str, limit: int | None = None) -> None:
        """One slot of `semaphore` taken by this process (and its fleet-wide limit, if known)."""
        name = self._semaphores(semaphore)
        self.semaphore_held.labels(name).inc()
        if limit is not None:
            self.semaphore_limit.labels(name).set(limit)

    def semaphore_released(self, semaphore: str) -> None:
        """One slot of `semaphore` given back (released, or its lease lost)."""
        self.semaphore_held.labels(self._semaphores(semaphore)).dec()

    @contextmanager
    def holding_slot(self, semaphore: str, limit: int | None = None) -> Iterator[None]:
        """`semaphore_acquired` on entry, `semaphore_released` on exit, whatever happens."""
        self.semaphore_acquired(semaphore, limit)
        try:
            yield
        finally:
            self.semaphore_released(semaphore)

    def semaphore_waited(self, semaphore: str, seconds: float) -> None:
        """A slot of `semaphore` granted after waiting `seconds` (0 when free at once)."""
        self.semaphore_wait.labels(self._semaphores(semaphore)).observe(max(0.0, seconds))

    def semaphore_requeued(self, semaphore: str) -> None:
        """A job found no slot of `semaphore` in time and was published again."""
        self.semaphore_requeues.labels(self._semaphores(semaphore)).inc()

    # -- global rate limits ----------------------------------------------------------
    # `limit` is the rate limit's declared name (or its task's name), never its key.

    def rate_limit_waited(self, limit: str, seconds: float) -> None:
        """A call admitted by `limit` after waiting `seconds` (0 when admitted at once)."""
        self.rate_limit_wait.labels(self._limits(limit)).observe(max(0.0, seconds))

    def rate_limit_denied(self, limit: str, action: str = "retry") -> None:
        """A call `limit` refused; `action`: what the caller did (retry, skip, raise)."""
        self.rate_limit_denials.labels(self._limits(limit), action).inc()

    # -- leader election ---------------------------------------------------------
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
