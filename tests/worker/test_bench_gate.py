"""The gate benchmark runs its cases on a private server and reports the ratio to the pair."""

from __future__ import annotations

from devstack.bench import gate_bench
from devstack.redis_server import RedisServer


def test_the_gate_bench_times_every_case_and_reports_the_ratio() -> None:
    with RedisServer() as server, gate_bench.Bench(server.url) as bench:
        cases = gate_bench.run(bench, calls=3, rounds=2, warmup=1)
        report = gate_bench.build_report(server.url, "x", cases, calls=3, rounds=2, warmup=1)
        prof = gate_bench.profile(bench, calls=3)
    names = [r["name"] for r in report["rows"]]
    assert names[:2] == [gate_bench.PAIR, gate_bench.GATED]
    assert gate_bench.EXECUTOR in names and gate_bench.IDENTITY in names
    assert all(len(c.seconds) == 2 and all(s > 0 for s in c.seconds) for c in cases)
    assert report["ratio"] > 0 and "gated_call_within_1_6x_pair" in report["targets"]
    report["profile"] = prof
    text = gate_bench.format_report(report)
    assert "gated call / pair" in text and "_gated" in prof["text"]


def test_a_gated_call_in_the_bench_runs_the_body_once_and_stores_its_result() -> None:
    with RedisServer() as server, gate_bench.Bench(server.url) as bench:
        n = 424242
        assert gate_bench.as_worker_calls(bench.gated, (n,)) == n
        key, _ = bench.gated.identity((n,), {})
        record = bench.runtime.backend.job_record(key)
    assert record is not None and record.state == "DONE" and record.result == str(n)


def test_the_cli_knows_the_gate_bench() -> None:
    from jobfence.worker.cli import BENCHES

    assert BENCHES["gate"] == "devstack.bench.gate_bench"
    args = gate_bench.parse_args(["--calls", "5", "--json", "--profile", "10"])
    assert (args.calls, args.json, args.profile) == (5, "-", 10)
