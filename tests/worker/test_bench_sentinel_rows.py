"""The lock benchmark's Sentinel row runs on a private topology beside the same master direct."""

from __future__ import annotations

from devstack.bench import locks_bench, sentinel_rows


def test_the_sentinel_row_runs_beside_the_single_node() -> None:
    rep = sentinel_rows.run(pairs=5, rounds=2, warmup=2)
    names = [r["name"] for r in rep["rows"]]
    assert names == [sentinel_rows.SINGLE, sentinel_rows.SENTINEL]
    assert all(r["us_per_pair"] > 0 for r in rep["rows"]) and rep["vs_single"] > 0
    assert "Sentinel / 1 node" in "\n".join(sentinel_rows.format_rows(rep))


def test_the_sentinel_row_can_be_skipped() -> None:
    assert locks_bench.parse_args(["--sentinel-pairs", "0"]).sentinel_pairs == 0
    assert locks_bench.parse_args([]).sentinel_pairs == 500
