"""RedisEffects: a Redis effect and its DONE record in one script, so a lock server that lost
its data cannot run the effect twice (issue 29, defect 14). The control: the same re-run
through a bare RedisFenceGuard lands twice, as a guard refuses older fences, not re-runs."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from devstack.redis_server import RedisServer
from jobfence.locks import Backoff, LeaseKeeper, RedisBackend, RedisFenceGuard, StaleFence
from jobfence.locks.errors import FencedWriteRefused, LockError
from jobfence.tasks import Executor, IdempotencyConflict, JobContext, RedisEffects
from jobfence.tasks.keys import identity
from tests.tasks.conftest import job_with_fence, spec_for

TASK = "shop.tasks.reserve_stock"


@pytest.fixture
def lock_server() -> Iterator[RedisServer]:
    """The lock server whose data the test loses (FLUSHALL: a failover to an empty replica)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def effects_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _run_twice_losing_the_lock_data(
    lock_server: RedisServer, body: Any, item: str
) -> list[tuple[str, int]]:
    """Run one job, lose every key of the lock server, run the same job again: (status, fence)."""
    backend = RedisBackend.from_url(lock_server.url)
    keeper = LeaseKeeper()
    executor = Executor(backend, keeper, backoff=Backoff(0.005, 0.05))
    key, fp = identity(b"secret-of-the-test-0123456789abcdef", TASK, {"item": item})
    seen: list[tuple[str, int]] = []
    try:
        for _ in range(2):
            spec = spec_for(key, name=TASK, fingerprint=fp)
            out = executor.run(spec, body)
            seen.append((out.status, out.fence or 0))
            lock_server.client().flushall()  # the DONE record and the fence source are gone
    finally:
        keeper.stop()
        backend.close()
    return seen


def test_a_rerun_after_the_lock_server_lost_its_data_takes_effect_once(
    lock_server: RedisServer, effects_client: redis.Redis
) -> None:
    item = uuid.uuid4().hex[:8]
    stock, resource = f"stock:{{{item}}}", f"{item}"
    effects_client.set(stock, 10)
    effects = RedisEffects(effects_client, prefix=f"re-{item}")

    def reserve(job: JobContext) -> Any:
        with effects.transaction(job, resource) as tx:
            if tx.done:
                return tx.result
            tx.write(("DECRBY", stock, 1))
            tx.result = {"reserved": 1}
        return tx.result

    seen = _run_twice_losing_the_lock_data(lock_server, reserve, item)
    assert [status for status, _ in seen] == ["ran", "ran"]  # the lock server forgot the job
    assert seen[1][1] > seen[0][1]  # granted again with a higher fence: a guard accepts it
    assert int(effects_client.get(stock) or 0) == 9  # ... yet the effect landed once
    record = effects.record(
        identity(b"secret-of-the-test-0123456789abcdef", TASK, {"item": item})[0], resource
    )
    assert record is not None and record["fence"] == seen[0][1]
    assert record["result"] == {"reserved": 1}


def test_control_a_fence_guard_alone_lets_the_rerun_land_twice(
    lock_server: RedisServer, effects_client: redis.Redis
) -> None:
    item = uuid.uuid4().hex[:8]
    stock = f"stock:{{{item}}}"
    effects_client.set(stock, 10)
    guard = RedisFenceGuard(effects_client, prefix=f"re-{item}")

    def reserve(job: JobContext) -> Any:
        guard.write(item, job.fence, [("DECRBY", stock, 1)])
        return {"reserved": 1}

    _run_twice_losing_the_lock_data(lock_server, reserve, item)
    assert int(effects_client.get(stock) or 0) == 8  # twice: the guard is no idempotency


def test_the_record_answers_a_racing_run_and_an_older_fence_is_stale(
    effects_client: redis.Redis,
) -> None:
    item = uuid.uuid4().hex[:8]
    stock = f"stock:{{{item}}}"
    effects = RedisEffects(effects_client, prefix=f"re-{item}")
    first, second = job_with_fence("k-" + item, 10), job_with_fence("k-" + item, 20)
    # Both open before either writes: the second's write finds the first's record.
    with effects.transaction(second, item) as late, effects.transaction(first, item) as early:
        assert not early.done and not late.done
        early.write(("INCR", stock))
        early.result = "first"
        late.write(("INCR", stock))
        late.result = "second"
    assert late.done and late.result == "first" and early.replies == [1]
    assert int(effects_client.get(stock) or 0) == 1
    other = job_with_fence("k2-" + item, 5)  # another job, an older fence on the resource
    with pytest.raises(StaleFence), effects.transaction(other, item) as tx:
        tx.write(("INCR", stock))
    assert int(effects_client.get(stock) or 0) == 1


def test_other_arguments_under_the_key_are_refused(effects_client: redis.Redis) -> None:
    item = uuid.uuid4().hex[:8]
    effects = RedisEffects(effects_client, prefix=f"re-{item}")
    with effects.transaction(job_with_fence("k-" + item, 1, "fp-a"), item) as tx:
        tx.result = 1
    with pytest.raises(IdempotencyConflict), effects.transaction(
        job_with_fence("k-" + item, 2, "fp-b"), item
    ):
        pass  # pragma: no cover - refused on entry
    # A record that appears between the look-up and the write is checked in the script too.
    racing = job_with_fence("k3-" + item, 3, "fp-c")
    with pytest.raises(FencedWriteRefused, match="other arguments"), effects.transaction(
        racing, item
    ) as tx:
        with effects.transaction(job_with_fence("k3-" + item, 4, "fp-d"), item) as other:
            other.result = "d"
        tx.result = "c"


def test_bad_record_ttl_names_the_field(effects_client: redis.Redis) -> None:
    with pytest.raises(LockError, match="record_ttl"):
        RedisEffects(effects_client, record_ttl=0)


def test_a_record_under_the_previous_key_secret_answers_during_a_rotation(
    effects_client: redis.Redis,
) -> None:
    """The job done under the old secret, delivered again under the new one (its lock data
    lost): the record under the old key answers, nothing is applied again."""
    item = uuid.uuid4().hex[:8]
    stock = f"stock:{{{item}}}"
    effects = RedisEffects(effects_client, prefix=f"re-{item}")
    old = job_with_fence("old-" + item, 1, "fp-old")
    with effects.transaction(old, item) as tx:
        tx.write(("INCR", stock))
        tx.result = "once"
    new = dataclasses.replace(
        job_with_fence("new-" + item, 2, "fp-new"), previous=(("old-" + item, "fp-old"),)
    )
    with effects.transaction(new, item) as again:
        assert again.done and again.result == "once"
    assert int(effects_client.get(stock) or 0) == 1
