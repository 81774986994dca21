"""The lock benchmark's etcd row: runs on a private etcd it starts itself, and stops it."""

from __future__ import annotations

import pytest

from devstack.bench import etcd_rows, locks_bench
from devstack.local_etcd import etcd_unavailable
from devstack.procs import pid_alive


def test_etcd_row_starts_its_own_etcd_measures_and_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if etcd_unavailable():
        pytest.skip(str(etcd_unavailable()))
    started: list[int] = []
    real = etcd_rows.EtcdCluster.start

    def spy(self: etcd_rows.EtcdCluster) -> etcd_rows.EtcdCluster:
        got = real(self)
        started.append(got.pid(0))
        return got

    monkeypatch.setattr(etcd_rows.EtcdCluster, "start", spy)
    args = locks_bench.parse_args(["--rounds", "1", "--waiters", "2", "--sql-pairs", "3"])
    assert args.etcd is None  # the default: a private etcd
    etcd = etcd_rows.run(args.etcd, pairs=3, rounds=1, warmup=0, trials=2, seed=1)
    row = etcd["row"]
    assert row["name"] == etcd_rows.NAME and row["us_per_pair"] > 0
    assert row["wake_n"] == 2 and not row["wake_errors"]
    assert row["requests_per_pair"] == 2.0  # the grant txn and the release txn
    assert set(etcd["targets"]) == {"etcd_pair_under_3ms", "etcd_wakeup_median_under_10ms"}
    assert "etcd lease" in "\n".join(etcd_rows.format_rows(etcd))
    (pid,) = started
    assert not pid_alive(pid), "the private etcd was left running"
    skipped = etcd_rows.run("", pairs=3, rounds=1, warmup=0, trials=1, seed=1)
    assert "not asked for" in skipped["skipped"]
