"""The lock benchmark's Redlock rows run on their own private masters and count orphans."""

from __future__ import annotations

from devstack.bench import locks_bench, redlock_rows


def test_redlock_rows_run_and_report_orphaned_keys() -> None:
    rep = redlock_rows.run(pairs=5, rounds=2, warmup=2)
    rows = {r["name"]: r for r in rep["rows"]}
    assert set(rows) == {
        redlock_rows.SINGLE,
        redlock_rows.REDLOCK_3,
        redlock_rows.REDLOCK_5,
        redlock_rows.REDLOCK_5_TWO,
        redlock_rows.POTTERY_5,
        redlock_rows.FLOOR_1,
        redlock_rows.FLOOR_5,
    }
    for name, row in rows.items():
        assert row["pairs_run"] == 12 and row["us_per_pair"] > 0, name
        if name.startswith("jobfence"):
            assert row["orphaned_lock_keys"] == 0 and row["fence"], name
    assert rep["targets"]["redlock_zero_orphans"]
    text = "\n".join(redlock_rows.format_rows(rep))
    assert "pottery Redlock, 5 masters" in text and "orphans" in text


def test_the_redlock_rows_can_be_skipped() -> None:
    assert locks_bench.parse_args(["--redlock-pairs", "0"]).redlock_pairs == 0
    assert locks_bench.parse_args([]).redlock_pairs == 500
