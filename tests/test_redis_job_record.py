"""Redis keeps one small key per finished job, and no fence key per lock key."""

from __future__ import annotations

import binascii
import itertools
import json
from collections.abc import Iterator

import pytest
import redis

from jobfence.locks import Backoff, JobRecord, Lease, LeaseKeeper, RedisBackend
from jobfence.locks.backends.redis import parse_record
from jobfence.locks.backends.redis.cluster_nodes import SLOTS, slot_tags
from jobfence.tasks import Executor
from jobfence.tasks.keys import identity
from tests.tasks.conftest import spec_for

TASK = "shop.tasks.charge_payment"  # a realistic task name: it is part of the key name
BYTES_PER_JOB = 250  # MEMORY USAGE of a finished job's keys, plus its stored result


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    b = RedisBackend.from_url(redis_url)
    yield b
    b.close()


def _keys(client: redis.Redis) -> set[bytes]:
    return set(client.scan_iter(count=1000))


def test_a_finished_job_leaves_one_key_within_the_byte_bound(
    backend: RedisBackend, redis_client: redis.Redis
) -> None:
    keeper = LeaseKeeper()
    executor = Executor(backend, keeper, backoff=Backoff(0.005, 0.05))
    results = [7, "ok", {"charged": 1250, "currency": "EUR", "receipt": "r-0001"}, None]
    before = _keys(redis_client)
    try:
        for n, result in enumerate(results * 5):
            key, fp = identity(b"secret", TASK, {"payment_id": n})
            spec = spec_for(key, name=TASK, fingerprint=fp, result_ttl=7 * 24 * 3600.0)
            assert executor.run(spec, lambda _ctx, r=result: r).status == "ran"
    finally:
        keeper.stop()
    new = _keys(redis_client) - before
    records = {n for n in new if n.startswith(b"jobfence:job:")}
    assert len(records) == len(results) * 5, "a finished job keeps exactly one record key"
    assert new - records <= {b"jobfence:fences"}, f"keys beyond the records: {new - records}"
    for name in records:
        stored = parse_record(redis_client.get(name).decode())  # type: ignore[union-attr]
        used = redis_client.memory_usage(name, samples=0)
        assert used is not None and used <= BYTES_PER_JOB + len(stored.result), (
            f"{name!r}: {used} bytes for a result of {len(stored.result)}"
        )
        assert stored.state == "DONE" and stored.finished_at > 0


def test_plain_locks_leave_no_key_behind_and_fences_still_rise(
    backend: RedisBackend, redis_client: redis.Redis
) -> None:
    fences = []
    for i in range(50):
        for key in (f"resource:{i}", "resource:shared"):
            lease = backend.try_acquire(key, 5.0)
            assert lease is not None
            fences.append((key, lease.fence))
            assert lease.release()
    assert _keys(redis_client) == {b"jobfence:fences"}, "a released lock leaves a key"
    shared = [f for k, f in fences if k == "resource:shared"]
    assert all(a < b for a, b in itertools.pairwise(shared))


def test_a_stepped_back_clock_still_gets_a_higher_fence_from_the_source(
    backend: RedisBackend, redis_client: redis.Redis
) -> None:
    """The source, not the clock, orders grants while it lives: a source far above the
    clock (as after a clock step back) gives source + 1, even to a client with no floor."""
    ahead = 9_000_000_000_000_000
    redis_client.set("jobfence:fences", ahead)
    fresh = RedisBackend(backend.client)  # no floor: it has seen no fence
    lease = fresh.try_acquire("stepped", 5.0)
    assert lease is not None and lease.fence == ahead + 1
    assert lease.release()
    again = fresh.try_acquire("stepped", 5.0)
    assert again is not None and again.fence == ahead + 2


def test_the_record_string_keeps_every_field(backend: RedisBackend) -> None:
    lease = backend.begin("odd", 5.0, record=True, fingerprint="fp:with,sep")
    assert isinstance(lease, Lease)
    result = json.dumps({"text": "ünï, cödé: 1,2", "n": [1, 2]}, ensure_ascii=False)
    assert backend.commit(lease, state="DONE", result=result, fingerprint="fp:with,sep",
                          result_ttl=60)  # fmt: skip
    record = backend.job_record("odd")
    assert record is not None
    assert (record.state, record.fingerprint, record.result, record.fence) == (
        "DONE", "fp:with,sep", result, lease.fence,
    )  # fmt: skip
    replay = backend.begin("odd", 5.0, record=True, fingerprint="fp:with,sep")
    assert replay == record


def test_a_record_hash_of_an_earlier_version_still_replays_and_a_failed_one_goes(
    backend: RedisBackend, redis_client: redis.Redis
) -> None:
    """A rolling upgrade: DONE records written as hashes keep answering duplicates."""
    old = {"state": "DONE", "result": "42", "fingerprint": "fp", "fence": "17",
           "finished_ms": "1700000000123"}  # fmt: skip
    redis_client.hset("jobfence:job:{old-done}", mapping=old)
    redis_client.hset("jobfence:job:{old-failed}", mapping={**old, "state": "FAILED"})
    expected = JobRecord(state="DONE", fingerprint="fp", result="42", fence=17,
                         finished_at=1700000000.123)  # fmt: skip
    assert backend.begin("old-done", 5.0, record=True, fingerprint="fp") == expected
    assert backend.job_record("old-done") == expected
    assert backend.job_record("old-failed") is not None
    lease = backend.begin("old-failed", 5.0, record=True, fingerprint="fp")
    assert isinstance(lease, Lease) and lease.fence > 17
    assert redis_client.exists("jobfence:job:{old-failed}") == 0
    assert backend.forget("old-done") and backend.job_record("old-done") is None


def test_every_cluster_slot_has_a_fence_source_tag_in_that_slot() -> None:
    tags = slot_tags()
    assert len(tags) == SLOTS
    assert all(binascii.crc_hqx(t.encode(), 0) % SLOTS == s for s, t in enumerate(tags))
    assert max(len(t) for t in tags) <= 3 and all(t.isalnum() for t in tags)
