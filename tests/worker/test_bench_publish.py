"""The publish benchmark: apply_async's CPU and round trips, @singleton_task beside plain Celery."""

from __future__ import annotations

import pytest

from devstack.bench import publish_bench
from devstack.redis_server import RedisServer


def test_the_publish_bench_counts_each_contenders_round_trips() -> None:
    with RedisServer() as server:
        cases = publish_bench.run(server.url, publishes=20, rounds=2, warmup=5)
        report = publish_bench.build_report(server.url, "x", cases, publishes=20, rounds=2,
                                            warmup=5)  # fmt: skip
    trips = {r["name"]: r["round_trips_per_publish"] for r in report["rows"]}
    # One LPUSH each; a claim at publish (jobfence's dedupe, the peers' locks) is one more.
    assert trips == {
        publish_bench.PLAIN: 1.0,
        publish_bench.JOBFENCE: 1.0,
        publish_bench.DEDUPE: 2.0,
        publish_bench.ONCE: 2.0,
        publish_bench.SINGLETON: 2.0,
    }
    assert report["dedupe_extra_trips"] == 1.0
    assert report["targets"]["dedupe_at_most_one_round_trip_more"]
    assert all(r["cpu_us_per_publish"] > 0 for r in report["rows"])
    text = publish_bench.format_report(report)
    assert "jobfence's publish CPU within 1.03x plain's" in text and "round trips" in text


def test_the_counter_counts_a_pipeline_as_one_round_trip() -> None:
    with RedisServer() as server:
        client = server.client()
        client.ping()  # connected first: redis-py's hand-shake (CLIENT SETINFO) is not counted
        with publish_bench.counting_writes() as count:
            client.ping()
            with client.pipeline(transaction=False) as pipe:
                pipe.set("a", 1).get("a").delete("a")
                pipe.execute()
        client.close()
    assert count[0] == 2


def test_the_cli_knows_the_publish_bench() -> None:
    from jobfence.worker.cli import BENCHES

    assert BENCHES["publish"] == "devstack.bench.publish_bench"
    with pytest.raises(SystemExit):
        publish_bench.parse_args(["--publishes", "0"])
