"""The decision log's bounds (Redis streams, the memory ring) and outage warnings summarised."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from devstack.redis_server import free_port
from jobfence.locks import Backoff, LeaseKeeper, MemoryBackend, RedisBackend
from jobfence.locks.decisions import Decision, DecisionBounds, RedisDecisionLog, RingDecisionLog
from jobfence.locks.outage import WarningLimiter
from jobfence.tasks import Executor
from jobfence.tasks.decisions import DecisionRecorder, describe
from jobfence.tasks.middleware import Decisions, OutageLines
from tests.tasks.conftest import spec_for, unique


def decision(key: str, task_id: str, at: float = 1000.0, event: str = "started") -> Decision:
    return Decision(at, event, key, "tests.job", task_id, fence=7)


@pytest.fixture
def redis_log(redis_url: str) -> Iterator[RedisDecisionLog]:
    backend = RedisBackend.from_url(redis_url, prefix=unique("dl"))
    store = backend.decision_log(DecisionBounds(per_key=5, total=200, ttl=60.0))
    assert isinstance(store, RedisDecisionLog)
    yield store
    backend.close()


def test_redis_keeps_per_key_at_most_its_cap_with_a_ttl(redis_log: RedisDecisionLog) -> None:
    key = unique("tests.job:k")
    for i in range(40):
        redis_log.append(decision(key, f"t{i}", at=1000.0 + i, event="conflict"))
    stream = redis_log.keys.decisions(key)
    assert redis_log.client.xlen(stream) == 5
    assert 0 < redis_log.client.pttl(stream) <= 60_000
    assert 0 < redis_log.client.pttl(redis_log.keys.decision_index()) <= 60_000
    assert [d.task_id for d in redis_log.for_key(key)] == [f"t{i}" for i in range(35, 40)]


def test_redis_keeps_a_routine_run_in_the_index_alone(redis_log: RedisDecisionLog) -> None:
    """A job that starts and finishes leaves no stream of its own (its record is its one key);
    its decisions come back from the index, merged by time with the key's stream."""
    key = unique("tests.job:k")
    redis_log.append_many([decision(key, "holder", 1.0), decision(key, "holder", 3.0, "done")])
    stream = redis_log.keys.decisions(key)
    assert redis_log.client.exists(stream) == 0
    redis_log.append(Decision(2.0, "conflict", key, "tests.job", "copy", holder="holder",
                              reason="skip"))  # fmt: skip
    assert redis_log.client.xlen(stream) == 1  # the conflict alone
    assert [(d.at, d.event, d.task_id, d.fence) for d in redis_log.for_key(key)] == [
        (1.0, "started", "holder", 7),
        (2.0, "conflict", "copy", None),
        (3.0, "done", "holder", 7),
    ]
    assert [d.event for d in redis_log.for_key(key, 2)] == ["conflict", "done"]
    assert [d.event for d in redis_log.for_task("holder")] == ["started", "conflict", "done"]
    # Another key's routine run is not this key's.
    redis_log.append(decision(unique("tests.job:k"), "other", 2.5, "done"))
    assert len(redis_log.for_key(key)) == 3


def test_redis_index_is_bounded_in_total(redis_log: RedisDecisionLog) -> None:
    for i in range(1000):
        redis_log.append_many([decision(f"tests.job:{i}", f"t{i}")])
    # MAXLEN ~: trimmed by whole stream nodes (100 entries each), never far past the cap.
    assert redis_log.client.xlen(redis_log.keys.decision_index()) <= 200 + 100


def test_redis_finds_a_task_by_its_id(redis_log: RedisDecisionLog) -> None:
    key = unique("tests.job:k")
    redis_log.append_many([decision(key, "holder", 1.0), decision(key, "holder", 2.0, "done")])
    redis_log.append(Decision(3.0, "conflict", key, "tests.job", "copy", holder="holder",
                              reason="skip"))  # fmt: skip
    found = redis_log.for_task("copy")
    assert [(d.task_id, d.event) for d in found] == [
        ("holder", "started"),
        ("holder", "done"),
        ("copy", "conflict"),
    ]
    assert found[-1].holder == "holder" and found[-1].reason == "skip"


def test_ring_is_bounded_per_key_in_total_and_in_time() -> None:
    now = [1000.0]
    ring = RingDecisionLog(DecisionBounds(per_key=3, total=6, ttl=10.0), clock=lambda: now[0])
    for i in range(10):
        ring.append(decision("a", f"a{i}"))
    assert [d.task_id for d in ring.for_key("a")] == ["a7", "a8", "a9"]
    ring.append_many([decision("b", "b0"), decision("c", "c0"), decision("c", "c1")])
    ring.append(decision("d", "d0"))  # 7 kept: the least recently written key ("a") goes
    assert ring.for_key("a") == [] and [d.task_id for d in ring.for_task("c1")] == ["c0", "c1"]
    now[0] += 11
    assert ring.for_key("d") == []


def test_an_executor_records_a_skipped_duplicate_with_its_holder() -> None:
    backend = MemoryBackend()
    keeper = LeaseKeeper()
    executor = Executor(backend, keeper, backoff=Backoff(0.005, 0.05))
    store = backend.decision_log(DecisionBounds())
    recorder = DecisionRecorder(store)
    executor.use(Decisions(recorder))
    key = unique("tests.job:k")
    try:
        holder = executor.begin(spec_for(key, task_id="holder"))
        out = executor.run(spec_for(key, task_id="copy"), lambda _ctx: None)
        assert out.status == "duplicate"
    finally:
        keeper.stop()
    assert store is not None
    recorder.flush()  # the writer thread stores within FLUSH_INTERVAL; now, here
    (conflict,) = store.for_task("copy")
    assert (conflict.event, conflict.holder, conflict.reason) == ("conflict", "holder", "skip")
    holder.release()  # type: ignore[union-attr]


def test_a_body_ending_after_its_lock_was_removed_is_recorded_as_what_happened() -> None:
    """Not "done ... stored its DONE record": the commit was refused, and it comes back."""
    backend = MemoryBackend()
    keeper = LeaseKeeper()
    executor = Executor(backend, keeper, backoff=Backoff(0.005, 0.05))
    store = backend.decision_log(DecisionBounds())
    assert store is not None
    recorder = DecisionRecorder(store)
    executor.use(Decisions(recorder))
    key = unique("tests.job:k")
    try:  # the body's lock removed under it (`jobfence locks release KEY --force`)
        out = executor.run(spec_for(key, task_id="t1"), lambda ctx: backend.force_release(ctx.key))
    finally:
        keeper.stop()
    assert out.status == "redeliver"
    assert backend.job_record(key) is None
    recorder.flush()
    said = [(d.event, describe(d)) for d in store.for_task("t1")]
    assert said == [
        ("started", "granted the lease (fence 1) and started the body"),
        ("commit_refused", "lease lost (fence 1) before its commit: the body ran to its end; "
                           "DONE record not stored"),
        ("redeliver", "redelivered: lease lost before commit; DONE record not stored"),
    ]  # fmt: skip


def test_a_failure_whose_record_was_not_stored_says_so() -> None:
    failed = Decision(1000.0, "failed", "k", "tests.job", "t", fence=3,
                      reason="record not stored: lease lost")  # fmt: skip
    assert describe(failed) == ("failed: granted the lease (fence 3), the body raised; FAILED "
                                "record not stored: lease lost")  # fmt: skip


# -- outage warnings ----------------------------------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_limiter_writes_a_burst_then_one_summary_with_the_count() -> None:
    now = [0.0]
    limiter = WarningLimiter("lock server unavailable", burst=3, window=10.0,
                             clock=lambda: now[0])  # fmt: skip
    logger = logging.getLogger(unique("tests.outage"))
    lines = _Lines()
    logger.addHandler(lines)
    for _ in range(232):
        limiter.warning(logger, "job %s: unavailable", "k")
        now[0] += 0.1
    limiter.flush()
    assert lines.lines[:3] == ["job k: unavailable"] * 3
    summaries = [s for s in lines.lines if s.startswith("lock server unavailable: ")]
    # 23.2 s of warnings: the windows at 0, 10 and 20 s each write 3 and count the rest.
    assert len(lines.lines) - len(summaries) == 9 and len(summaries) == 3
    assert sum(int(s.split(": ")[1].split()[0]) for s in summaries) == 232 - 9
    assert summaries[0].endswith(" warnings suppressed in the last 10 s")


@pytest.fixture
def dead_redis_executor() -> Iterator[Executor]:
    """An executor whose lock server is down (a port nothing listens on)."""
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.2)
    keeper = LeaseKeeper()
    yield Executor(backend, keeper, backoff=Backoff(0.005, 0.05))
    keeper.stop()
    backend.close()


@pytest.mark.parametrize("limited", [True, False], ids=["limited", "naive"])
def test_an_outage_writes_a_handful_of_lines_and_a_summary(
    dead_redis_executor: Executor, limited: bool
) -> None:
    """Control (naive): without the limiter every job writes its own warning."""
    limiter = WarningLimiter("lock server unavailable", burst=3 if limited else 10**6)
    dead = dead_redis_executor
    executor = Executor(dead.backend, dead.keeper, backoff=dead.backoff,
                        middleware=[OutageLines(limiter)])  # fmt: skip
    lines = _Lines()
    logger = logging.getLogger("jobfence.tasks.executor")
    logger.addHandler(lines)
    try:
        for _ in range(40):
            out = executor.run(spec_for(unique("tests.job:k")), lambda _ctx: None)
            assert out.status == "redeliver"
        limiter.flush()
    finally:
        logger.removeHandler(lines)
    if limited:
        assert len(lines.lines) == 4, lines.lines
        assert lines.lines[-1].startswith("lock server unavailable: 37 warnings suppressed")
    else:
        assert len(lines.lines) == 40


def test_redis_without_a_lane_sends_one_pipeline(redis_log: RedisDecisionLog) -> None:
    """A client the backend drives without its lane (a cluster's): redis-py's pipeline."""
    plain = RedisDecisionLog(redis_log.client, redis_log.keys, redis_log.bounds)
    key = unique("tests.job:k")
    plain.append_many([decision(key, "t1"), decision(key, "t1", event="done")])
    assert [d.event for d in plain.for_task("t1")] == ["started", "done"]


def test_a_redis_cluster_keeps_the_log_across_slots(redis_cluster: Any) -> None:
    """The key's stream and the index live in other slots: redis-py's cluster pipeline."""
    from jobfence.locks.backends.redis.cluster import RedisClusterBackend

    backend = RedisClusterBackend.from_url(redis_cluster.url, prefix=unique("rc"))
    try:
        store = backend.decision_log(DecisionBounds(per_key=3, total=100, ttl=60.0))
        assert store is not None
        key = unique("tests.job:k")
        for i in range(5):
            store.append_many([decision(key, "t1", at=1.0 + i, event="conflict"),
                               decision(key, "t2", at=9.0, event="conflict")])  # fmt: skip
        # The last 3 of the key's stream (t2's last two and t1's last), oldest first.
        assert [(d.task_id, d.at) for d in store.for_task("t1")] == [
            ("t1", 5.0), ("t2", 9.0), ("t2", 9.0)
        ]  # fmt: skip
        # A routine run goes to the index alone (its slot is not the key's).
        ran = unique("tests.job:k")
        store.append(decision(ran, "t3", at=10.0, event="done"))
        assert [(d.key, d.event) for d in store.for_task("t3")] == [(ran, "done")]
        assert isinstance(store, RedisDecisionLog)
        assert store.client.exists(store.keys.decisions(ran)) == 0
    finally:
        backend.close()


def test_why_says_when_nothing_is_recorded_or_nothing_is_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from jobfence.worker.cli import main

    assert main(["locks", "--lock-url", "memory://", "why", "no-such-task\x1b[2J"]) == 1
    out = capsys.readouterr().out
    assert "no decisions recorded for" in out and "\x1b" not in out and "\\x1b" in out
    monkeypatch.setenv("JOBFENCE_DECISION_LOG_SIZE", "0")
    assert main(["locks", "--lock-url", "memory://", "why", "t1"]) == 2
    assert "keeps no decision log (JOBFENCE_DECISION_LOG_SIZE=0)" in capsys.readouterr().err
