"""The dashboard's live figures (/live): the locks held and their holders' verdicts, and the
waits, skips and lost leases summed from a worker's /metrics."""

from __future__ import annotations

import urllib.request

from jobfence.locks import LockBackend
from jobfence.worker.dashboard.data import LockView

LIVE_METRICS = {  # live figure -> the metric whose samples are summed
    "waits": "jobfence_acquire_wait_seconds_count",
    "skips": "jobfence_conflicts_total",
    "lost_leases": "jobfence_lost_leases_total",
}
MAX_COUNTED = 10_000  # locks counted at most, per figure update


def lock_counts(view: LockView, backend: LockBackend, now: float) -> dict[str, int | None]:
    """Locks held, and how many of their holders are dead, stopped or suspect at `now`."""
    counts: dict[str, int | None] = {"locks": 0, "dead": 0, "stopped": 0, "suspect": 0}
    for n, info in enumerate(backend.scan("*")):
        if n >= MAX_COUNTED:
            break
        counts["locks"] = n + 1
        verdict = view.row(info, now).verdict
        if verdict in counts:
            counts[verdict] = (counts[verdict] or 0) + 1
    return counts


def scraped(metrics_url: str) -> dict[str, int | None]:
    """Each LIVE_METRICS figure summed from `metrics_url`; None each if there is none or it
    does not answer (unknown, not zero)."""
    if not metrics_url:
        return dict.fromkeys(LIVE_METRICS)
    from prometheus_client.parser import text_string_to_metric_families

    sums = dict.fromkeys(LIVE_METRICS.values(), 0.0)
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return dict.fromkeys(LIVE_METRICS)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return {k: int(sums[m]) for k, m in LIVE_METRICS.items()}
