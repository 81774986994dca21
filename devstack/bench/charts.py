"""The PNG charts of the bench reports; matplotlib is imported only when a chart is drawn."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def locks_chart(results: Mapping[str, Any], path: Path) -> None:
    """Three panels over every backend: pair latency, wake-up delay, pairs/s at 1 and N."""
    import matplotlib.pyplot as plt

    section = results["backends"]
    rows = section["rows"]
    n = section["settings"]["clients"]
    names = [r["name"] for r in rows]
    ys = list(range(len(rows)))
    height = max(3.0, 0.42 * len(rows) + 1.5)
    fig, (ax_pair, ax_wake, ax_tput) = plt.subplots(
        1, 3, figsize=(17, height), sharey=True, gridspec_kw={"width_ratios": [1, 1, 1.3]}
    )

    def bars(ax: Any, values: list[tuple[float, float, float] | None], label: str) -> None:
        mids = [v[0] if v else 0.0 for v in values]
        lo = [v[0] - v[1] if v else 0.0 for v in values]
        hi = [v[2] - v[0] if v else 0.0 for v in values]
        ax.barh(ys, mids, xerr=[lo, hi], color="#4c72b0", ecolor="#333333", capsize=3)
        for y, v in zip(ys, values, strict=True):
            if v is None:
                ax.text(1, y, " n/a", va="center", fontsize=8, color="#777777")
            else:
                ax.text(v[0], y + 0.3, f" {_fmt(v[0])}", va="center", fontsize=7, color="#222222")
        if any(m > 0 for m in mids):  # log of nothing but zeros warns
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(axis="x", which="both", alpha=0.3)

    pair = [
        (r["pair_us"]["median"], r["pair_us"]["p10"], r["pair_us"]["p90"]) if r["pair_us"] else None
        for r in rows
    ]
    bars(ax_pair, pair, "acquire+release, µs per pair (median, bar p10-p90), log")
    wake = [
        (r["wake"]["median_ms"], r["wake"]["p10_ms"], r["wake"]["p90_ms"])
        if r["wake"] and r["wake"].get("n")
        else None
        for r in rows
    ]
    bars(ax_wake, wake, "release → blocked waiter acquires, ms (median, p10-p90), log")
    series = [
        ("pairs_per_s_1", "1 client", "#55a868"),
        ("pairs_per_s_n", f"{n} clients, own keys", "#4c72b0"),
        ("pairs_per_s_contended", f"{n} clients, one key", "#c44e52"),
    ]
    width = 0.8 / len(series)
    for i, (key, label, color) in enumerate(series):
        offs = [y - 0.4 + width * (i + 0.5) for y in ys]
        med = [r[key]["median"] if r[key] else 0.0 for r in rows]
        err_lo = [r[key]["median"] - r[key]["min"] if r[key] else 0.0 for r in rows]
        err_hi = [r[key]["max"] - r[key]["median"] if r[key] else 0.0 for r in rows]
        ax_tput.barh(
            offs,
            med,
            height=width,
            xerr=[err_lo, err_hi],
            label=label,
            color=color,
            ecolor="#333333",
            capsize=2,
        )
    ax_tput.set_xscale("log")
    ax_tput.set_xlabel("pairs per second (median of rounds, bar min-max), log")
    ax_tput.legend(loc="lower right", fontsize=8)
    ax_tput.grid(axis="x", which="both", alpha=0.3)
    ax_pair.set_yticks(ys)
    ax_pair.set_yticklabels(names)
    ax_pair.invert_yaxis()
    from devstack.bench.report import machine_info

    m = machine_info()
    fig.suptitle(
        f"jobfence bench locks: every backend in one run ({m['date']}, {m['cores']} cores, "
        f"Python {m['python']}; client and servers share the machine)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _hbars(ax: Any, names: list[str], mids: list[float], lo: list[float], hi: list[float],
           label: str) -> None:  # fmt: skip
    ys = list(range(len(names)))
    err = [[max(0.0, m - a) for m, a in zip(mids, lo, strict=True)],
           [max(0.0, b - m) for m, b in zip(mids, hi, strict=True)]]  # fmt: skip
    ax.barh(ys, mids, xerr=err, color="#4c72b0", ecolor="#333333", capsize=3)
    for y, m in zip(ys, mids, strict=True):
        ax.text(m, y + 0.3, f" {_fmt(m)}", va="center", fontsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel(label)
    ax.grid(axis="x", alpha=0.3)


def gate_chart(results: Mapping[str, Any], path: Path) -> None:
    """µs per call of every case of `bench gate` (median of rounds, bar min-max)."""
    import matplotlib.pyplot as plt

    rows = [r for r in results.get("rows", []) if "us_per_call" in r]
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.4 * len(rows) + 1.2)))
    _hbars(
        ax,
        [r["name"] for r in rows],
        [r["us_per_call"] for r in rows],
        [r.get("us_min", r["us_per_call"]) for r in rows],
        [r.get("us_max", r["us_per_call"]) for r in rows],
        "µs per call (median of rounds, bar min-max)",
    )
    fig.suptitle("jobfence bench gate: the task layer's own cost in one process")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def celery_chart(results: Mapping[str, Any], path: Path) -> None:
    """Jobs/s of every contender of `bench celery` and its executions of the storm job."""
    import matplotlib.pyplot as plt

    rows = [r for r in results.get("contenders", []) if "jobs_per_s" in r]
    names = [r["name"] for r in rows]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, max(2.5, 0.45 * len(rows) + 1.2)), sharey=True
    )
    per_round = [r.get("jobs_per_s_rounds") or [r["jobs_per_s"]] for r in rows]
    _hbars(
        left,
        names,
        [r["jobs_per_s"] for r in rows],
        [min(v) for v in per_round],
        [max(v) for v in per_round],
        "jobs per second (median of rounds, bar min-max)",
    )
    storm = [float(r.get("storm_executions") or 0) for r in rows]
    right.barh(range(len(rows)), storm, color="#c44e52")
    for y, v in enumerate(storm):
        right.text(v, y, f" {_fmt(v)}", va="center", fontsize=8)
    right.set_xlabel("executions of one job published many times (1 is right)")
    right.grid(axis="x", alpha=0.3)
    fig.suptitle("jobfence bench celery: one fleet of real workers")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
