"""The lock benchmark's Cluster rows: one node and a private 3-master cluster, 1 and N clients."""

from __future__ import annotations

from devstack.bench import cluster_rows, locks_bench


def test_cluster_rows_run_with_several_client_processes() -> None:
    rep = cluster_rows.run(procs=(1, 2), pairs=20, rounds=1, warmup=2)
    rows = {(r["name"], r["procs"]): r for r in rep["rows"]}
    assert set(rows) == {(name, n) for n in (1, 2) for name in
                         ("jobfence Redis, 1 node", "jobfence Cluster, 3 masters")}  # fmt: skip
    for key, row in rows.items():
        assert row["pairs_per_s"] > 0 and row["client_cpu_us"] > 0, key
    text = "\n".join(cluster_rows.format_rows(rep))
    assert "jobfence Cluster, 3 masters" in text and "cpu ceiling" in text


def test_the_cluster_rows_can_be_skipped() -> None:
    assert locks_bench.parse_args(["--cluster-pairs", "0"]).cluster_pairs == 0
    assert locks_bench.parse_args([]).cluster_pairs == 2000
