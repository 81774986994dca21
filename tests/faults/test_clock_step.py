"""Row g: the lock server's wall clock stepped forward and back (redis-server under libfaketime).

Fault: the lock server runs under libfaketime and the test steps its wall clock an hour
forward (every lease expires at once on the server, while its holder's own deadline is
still far off) and an hour back, with and without losing its data in between (a restart,
or a VM restored from a snapshot with a stale clock). The resources live apart from the
lock server (another redis-server, an SQL database) and keep their data.

Control: a naive fence taken from the server's clock alone, or from INCR, comes out equal
to or lower than an earlier one after the data loss and the step back; the stale holder's
write then carries the higher (or the same) fence and the guard accepts both writes: the
double effect.

jobfence: fences are max(last + 1, server microseconds, floor + 1), where the floor is the
highest fence the client has been granted. A forward step gives the next holder a higher
fence, so the stale holder's write is refused (StaleFence) and its next extension says it
lost the lease. A backward step while the fence key exists gives last + 1; after a data
loss the floor keeps a client's fences increasing. A client that has seen no fence (a new
process) can be granted a lower fence after a data loss and a step back: the guard of a
resource that saw the higher one refuses it, and where the stale holder writes after it,
the job's DONE row (written with the first effect) keeps the effect from happening twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import BigInteger, Column, Engine, MetaData, String, Table, func, select

from jobfence.locks.acquire import Backoff
from jobfence.locks.backends.redis import RedisBackend
from jobfence.locks.errors import NotOwner, StaleFence
from jobfence.locks.guards import RedisFenceGuard
from jobfence.locks.keeper import LeaseKeeper
from jobfence.locks.lease import Lease
from jobfence.tasks.context import JobContext
from jobfence.tasks.effects import SqlEffects
from jobfence.tasks.executor import Executor, JobSpec
from tests.faults.clock import ServerClock
from tests.servers import RedisServer
from tests.tasks.conftest import sql_effects

pytestmark = pytest.mark.fault

HOUR = 3600
TTL = 30.0  # long: only the server's clock step ends a lease in these tests

ledger_metadata = MetaData()
ledger = Table(
    "row_g_ledger",
    ledger_metadata,
    Column("job_key", String(255), nullable=False),
    Column("fence", BigInteger, nullable=False),
)


@pytest.fixture
def guard(fresh_redis: RedisServer) -> RedisFenceGuard:
    """A fence guard on a store apart from the lock server: it keeps its data."""
    return RedisFenceGuard(fresh_redis.client(decode_responses=True))


@pytest.fixture
def effects(sqlite_url: str) -> Iterator[SqlEffects]:
    with sql_effects(sqlite_url, ledger_metadata) as fx:
        yield fx


def entries(store: RedisFenceGuard, name: str) -> list[str]:
    return [str(item) for item in store.client.lrange(name, 0, -1)]


def ledger_rows(engine: Engine, job_key: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).select_from(ledger).where(ledger.c.job_key == job_key)
            ).scalar_one()
        )


def charge(effects: SqlEffects) -> Callable[[JobContext], Any]:
    """A job body: one ledger row and the DONE row in one fenced transaction."""

    def body(job: JobContext) -> Any:
        with effects.transaction(job, f"resource:{job.key}") as tx:
            if tx.done:
                return tx.result
            tx.conn.execute(ledger.insert().values(job_key=job.key, fence=job.fence))
            tx.result = {"fence": job.fence}
        return tx.result

    return body


# --------------------------------------------------------------------------- control


def naive_fence(server: RedisServer, source: str) -> int:
    client = server.client()
    if source == "server-time":
        seconds, micros = client.time()
        return int(seconds) * 1_000_000 + int(micros)
    return int(client.incr("naive:fence"))


@pytest.mark.parametrize("source", ["server-time", "incr"])
def test_control_naive_fence_repeats_or_decreases(
    server_clock: ServerClock, stepped_redis: RedisServer, guard: RedisFenceGuard, source: str
) -> None:
    stale = naive_fence(stepped_redis, source)  # holder A, which stalls before writing
    stepped_redis.restart()  # the lock server loses its data ...
    server_clock.step(-HOUR)  # ... and its clock steps back
    fresh = naive_fence(stepped_redis, source)  # holder B, once A's lock is gone
    assert fresh <= stale  # a repeat (INCR) or a decrease (the clock)
    # Each holder names its own write (write_id): to the guard, an equal fence is the same
    # holder writing again, so the repeated token lets the stale holder's write through.
    guard.write("naive:account", fresh, [("RPUSH", "naive:ledger", "B")], write_id="B")
    guard.write("naive:account", stale, [("RPUSH", "naive:ledger", "A")], write_id="A")
    assert entries(guard, "naive:ledger") == ["B", "A"]  # the double effect


# --------------------------------------------------------------------------- jobfence


@pytest.fixture
def lock_backend(stepped_redis: RedisServer) -> Iterator[RedisBackend]:
    backend = RedisBackend.from_url(stepped_redis.url)
    yield backend
    backend.close()


def test_forward_step_gives_the_next_holder_a_higher_fence_and_refuses_the_stale_write(
    server_clock: ServerClock, lock_backend: RedisBackend, guard: RedisFenceGuard
) -> None:
    stale = lock_backend.try_acquire("job:g-forward", TTL)
    assert stale is not None and stale.remaining() > TTL / 2
    server_clock.step(+HOUR)  # the lease expires on the server at once
    newer = lock_backend.try_acquire("job:g-forward", TTL)
    assert newer is not None, "the server clock step did not expire the lease"
    assert newer.fence > stale.fence
    guard.write("account:forward", newer.fence, [("RPUSH", "ledger:forward", "newer")])
    with pytest.raises(StaleFence):
        guard.write("account:forward", stale.fence, [("RPUSH", "ledger:forward", "stale")])
    with pytest.raises(NotOwner):  # the keeper's next extension tells the stale holder
        lock_backend.extend(stale)
    assert stale.lost
    assert entries(guard, "ledger:forward") == ["newer"]


def test_backward_step_keeps_fences_increasing(
    server_clock: ServerClock, stepped_redis: RedisServer, lock_backend: RedisBackend
) -> None:
    fences = []
    for step in (+HOUR, -2 * HOUR):
        lease = lock_backend.try_acquire("job:g-back", TTL)
        assert lease is not None
        fences.append(lease.fence)
        lease.release()
        server_clock.step(step)
    # The fence key is there: last + 1, although the server clock is an hour behind.
    lease = lock_backend.try_acquire("job:g-back", TTL)
    assert lease is not None
    fences.append(lease.fence)
    lease.release()
    # The data is lost with the clock still behind: the client's floor keeps it increasing.
    stepped_redis.restart()
    for key in ("job:g-back", "job:g-other"):
        lease = lock_backend.try_acquire(key, TTL)
        assert lease is not None
        fences.append(lease.fence)
        lease.release()
    assert fences == sorted(set(fences)), fences  # strictly increasing


def test_lower_fence_after_data_loss_and_step_back_is_refused(
    server_clock: ServerClock, stepped_redis: RedisServer, effects: SqlEffects
) -> None:
    key = "job:g-refused"
    body = charge(effects)
    keeper = LeaseKeeper()
    first = RedisBackend.from_url(stepped_redis.url)
    spec = JobSpec(name="row_g", key=key, fingerprint="fp", ttl=TTL, result_ttl=600)
    try:
        done = Executor(first, keeper, backoff=Backoff()).run(spec, body)
        assert done.status == "ran" and ledger_rows(effects.engine, key) == 1
        stepped_redis.restart()  # DONE record and fence counter lost ...
        server_clock.step(-HOUR)  # ... and the server clock an hour behind
        # A new worker process (it has seen no fence) gets the job again.
        newcomer = RedisBackend.from_url(stepped_redis.url)
        try:
            again = Executor(newcomer, keeper, backoff=Backoff()).run(spec, body)
        finally:
            newcomer.close()
        assert again.fence is not None and again.fence < done.value["fence"]  # the decrease
        assert again.status != "ran"  # refused by the resource's guard: StaleFence
        assert ledger_rows(effects.engine, key) == 1
    finally:
        keeper.stop()
        first.close()


def test_stale_holder_writing_after_a_lower_fenced_newcomer_changes_nothing(
    server_clock: ServerClock, stepped_redis: RedisServer, effects: SqlEffects
) -> None:
    key = "job:g-after"
    body = charge(effects)
    old = RedisBackend.from_url(stepped_redis.url)
    try:
        stale = old.begin(key, TTL, record=True, fingerprint="fp")
        assert isinstance(stale, Lease)
        stepped_redis.restart()
        server_clock.step(-HOUR)
        newcomer = RedisBackend.from_url(stepped_redis.url)
        keeper = LeaseKeeper()
        try:
            spec = JobSpec(name="row_g", key=key, fingerprint="fp", ttl=TTL, result_ttl=600)
            ran = Executor(newcomer, keeper, backoff=Backoff()).run(spec, body)
        finally:
            keeper.stop()
            newcomer.close()
        assert ran.status == "ran" and ran.fence is not None
        assert ran.fence < stale.fence
        # The stale holder, whose lease the server forgot, writes anyway with its higher
        # fence: the guard lets it through, and the job's DONE row stops the effect.
        job = JobContext(key=key, fingerprint="fp", lease=stale)
        assert body(job) == {"fence": ran.fence}
        assert ledger_rows(effects.engine, key) == 1
    finally:
        old.close()
