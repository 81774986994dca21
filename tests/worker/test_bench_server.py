"""The server-cost benchmark: commandstats µs per operation, jobfence beside redis-py Lock."""

from __future__ import annotations

from devstack.bench import server_bench
from devstack.redis_server import RedisServer


def test_the_server_bench_reports_every_operation_and_both_ratios() -> None:
    with RedisServer() as server:
        got = server_bench.run(server.url, ops=20, rounds=2)
        report = server_bench.build_report(server.url, "x", got, ops=20, rounds=2)
    rows = {(r["case"], r["op"]): r for r in report["rows"]}
    assert set(rows) == {(c, p) for c, p, _ in server_bench.PHASES}
    assert all(r["usec"] > 0 for r in rows.values())
    # A script's inner commands are listed apart: begin writes the lock hash and its TTL.
    assert {"hset", "pexpire", "time"} <= set(rows["jobfence lock", "acquire"]["inner"])
    assert rows["redis-py Lock", "acquire"]["inner"] == {}  # a plain SET, no script
    assert report["pair_ratio"] > 0 and report["job_ratio"] > 0
    text = server_bench.format_report(report)
    assert "jobfence pair within 1.9x redis-py Lock's" in text
