"""Fenced writes under resends and failures on real Redis and SQL: applied once or not at all.

Each fault runs against a naive control first (the fenced-write script as it was, or the SQL
guard alone), which shows the double or the partial write; then against the guard.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa
from redis.backoff import NoBackoff
from redis.retry import Retry

from jobfence.locks import (
    FencedWriteRefused,
    LockError,
    MemoryBackend,
    PartialFencedWrite,
    RedisFenceGuard,
    SqlFenceGuard,
    StaleFence,
    StaleFenceOutcomeUnknown,
)
from jobfence.tasks.context import JobContext
from jobfence.tasks.effects import SqlEffects
from tests.proxy import FaultProxy, command
from tests.servers import RedisServer

# The fenced-write script before writes became idempotent (its exact token comparison
# simplified): the naive control.
NAIVE_FENCED_WRITE = """
local last = redis.call('GET', KEYS[1])
if last and tonumber(ARGV[1]) < tonumber(last) then return {0, last} end
redis.call('SET', KEYS[1], ARGV[1])
local out = {1, ARGV[1]}
for _, cmd in ipairs(cjson.decode(ARGV[2])) do
  local reply = redis.call(unpack(cmd))
  if type(reply) == 'table' and reply.ok then reply = reply.ok end
  out[#out + 1] = reply
end
return out
"""
FENCE = 1_795_271_197_229_967
PAY = [("HINCRBY", "acct:1", "balance", "-10"), ("RPUSH", "ledger:1", "pay-10")]


def _naive_args(fence: int = FENCE) -> tuple[list[str], list[object]]:
    return ["rfence:acct:1", "acct:1", "ledger:1"], [fence, json.dumps(PAY)]


def _account(client: redis.Redis) -> tuple[int, int]:
    """(balance, ledger entries) of account 1."""
    return int(client.hget("acct:1", "balance") or 0), int(client.llen("ledger:1"))


@pytest.fixture
def account(redis_client: redis.Redis) -> redis.Redis:
    redis_client.hset("acct:1", "balance", 100)
    return redis_client


@pytest.fixture
def retrying_client(
    redis_server: RedisServer, account: redis.Redis
) -> Iterator[tuple[redis.Redis, FaultProxy]]:
    """redis-py as configured by default (it retries on a timeout), through a proxy."""
    with FaultProxy(redis_server.host, redis_server.port) as proxy:
        client = redis.Redis(host=proxy.host, port=proxy.port, socket_timeout=0.5)
        assert client.get_retry() is not None and client.get_retry().get_retries() > 0
        yield client, proxy
        client.close()


# --------------------------------------------------------------------------- resends


def test_naive_script_sent_twice_applies_twice(account: redis.Redis) -> None:
    naive = account.register_script(NAIVE_FENCED_WRITE)
    keys, args = _naive_args()
    naive(keys=keys, args=args)
    naive(keys=keys, args=args)  # the resend of a write whose reply was lost
    assert _account(account) == (80, 2)


def test_script_sent_twice_applies_once_and_answers_the_first_reply(account: redis.Redis) -> None:
    guard = RedisFenceGuard(account)
    r = f"account:{uuid.uuid4().hex}"
    keys = [guard.keys.resource_fence(r), guard.keys.resource_writes(r), "acct:1", "ledger:1"]
    args = [FENCE, "", json.dumps([list(c) for c in PAY])]
    first = guard.script(keys=keys, args=args)
    again = guard.script(keys=keys, args=args)
    assert first == [1, str(FENCE).encode(), 90, 1]
    assert again == [2, str(FENCE).encode(), 90, 1]  # 2: a replay of the stored answer
    assert _account(account) == (90, 1)
    assert guard.write(r, FENCE, PAY) == [90, 1]  # and through write(): the same
    assert _account(account) == (90, 1)


def test_retrying_client_resends_the_naive_script_and_applies_it_twice(
    retrying_client: tuple[redis.Redis, FaultProxy],
) -> None:
    client, proxy = retrying_client
    naive = client.register_script(NAIVE_FENCED_WRITE)
    client.script_load(NAIVE_FENCED_WRITE)  # warm: the dropped reply is the script's own
    dropped = proxy.drop_reply(match=command("EVALSHA", naive.sha))
    keys, args = _naive_args()
    reply = naive(keys=keys, args=args)
    assert dropped.fired.wait(10)
    assert reply[2:] == [80, 2]  # the client's retry ran it again
    assert _account(client) == (80, 2)


def test_guard_on_a_retrying_client_applies_once_when_a_reply_is_lost(
    retrying_client: tuple[redis.Redis, FaultProxy],
) -> None:
    client, proxy = retrying_client
    guard = RedisFenceGuard(client)
    guard.write(f"warm:{uuid.uuid4().hex}", 1, [])  # script loaded, connection open
    dropped = proxy.drop_reply(match=command("EVALSHA"))
    assert guard.write("account:1", FENCE, PAY) == [90, 1]
    assert dropped.fired.wait(10)
    assert _account(client) == (90, 1)


def test_a_lost_reply_then_a_newer_fence_is_reported_as_unknown_outcome(
    retrying_client: tuple[redis.Redis, FaultProxy], account: redis.Redis
) -> None:
    client, proxy = retrying_client
    guard = RedisFenceGuard(client)
    direct = RedisFenceGuard(account)
    guard.write(f"warm:{uuid.uuid4().hex}", 1, [])
    # While the first attempt's reply is lost, a newer holder writes.
    dropped = proxy.drop_reply(
        match=command("EVALSHA"), then=lambda: direct.write("account:1", FENCE + 1, [])
    )
    with pytest.raises(StaleFenceOutcomeUnknown) as refused:
        guard.write("account:1", FENCE, PAY)
    assert dropped.fired.wait(10)
    assert isinstance(refused.value, StaleFence) and refused.value.last == FENCE + 1
    assert _account(client) == (90, 1)  # the lost attempt did apply, once


def test_distinct_writes_under_one_fence_need_distinct_write_ids(account: redis.Redis) -> None:
    guard = RedisFenceGuard(account)
    guard.write("account:1", FENCE, PAY, write_id="pay-1")
    assert guard.write("account:1", FENCE, PAY, write_id="pay-2") == [80, 2]
    assert guard.write("account:1", FENCE, PAY, write_id="pay-1") == [90, 1]  # stored
    with pytest.raises(FencedWriteRefused, match="used under this fence with other commands"):
        guard.write("account:1", FENCE, [("HSET", "acct:1", "balance", "0")], write_id="pay-1")
    assert _account(account) == (80, 2)
    # A newer fence starts afresh: the same write id is a new write there.
    assert guard.write("account:1", FENCE + 1, PAY, write_id="pay-1") == [70, 3]


def test_advance_raises_the_floor_without_writing(account: redis.Redis) -> None:
    guard = RedisFenceGuard(account)
    guard.write("account:1", FENCE, PAY)
    assert guard.advance("account:1", FENCE + 5) == FENCE + 5
    assert guard.advance("account:1", FENCE + 1) == FENCE + 5  # never lowers it
    with pytest.raises(StaleFence):
        guard.write("account:1", FENCE + 4, PAY)
    assert _account(account) == (90, 1)


# --------------------------------------------------------------------------- part-way failures


def test_naive_script_failing_midway_keeps_the_first_writes(account: redis.Redis) -> None:
    naive = account.register_script(NAIVE_FENCED_WRITE)
    bad = [*PAY, ("HSET", "ledger:1", "n", "1")]  # ledger:1 is a list: WRONGTYPE
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        naive(keys=["rfence:acct:1"], args=[FENCE, json.dumps(bad)])
    assert _account(account) == (90, 1)  # half a payment
    with pytest.raises(redis.ResponseError):
        naive(keys=["rfence:acct:1"], args=[FENCE, json.dumps(bad)])
    assert _account(account) == (80, 2)  # and the retry applies the half again


@pytest.mark.parametrize(
    ("commands", "index", "reason"),
    [
        ([*PAY, ("HSET", "ledger:1", "n", "1")], 3, "holds a list, not a hash"),
        ([("SET", "tmp:1", "x"), *PAY, ("RPUSH", "tmp:1", "y")], 4, "holds a string"),
        ([*PAY, ("HINCRBY", "acct:1", "name", "1")], 3, "not a number"),
        ([*PAY, ("INCRBY", "n:1", "ten")], 3, "not an integer"),
        ([*PAY, ("HSET", "acct:1", "odd")], 3, "wrong number of arguments"),
    ],
)
def test_a_write_that_would_fail_midway_is_refused_whole(
    account: redis.Redis, commands: list[tuple[str, ...]], index: int, reason: str
) -> None:
    account.hset("acct:1", "name", "alice")
    guard = RedisFenceGuard(account)
    guard.write("account:1", FENCE, [], write_id="before")
    with pytest.raises(FencedWriteRefused) as refused:
        guard.write("account:1", FENCE + 1, commands)
    assert refused.value.index == index and reason in refused.value.reason
    assert _account(account) == (100, 0)
    assert account.exists("tmp:1") == 0
    assert guard.last("account:1") == FENCE  # the fence did not advance either


def test_commands_with_options_pass_the_check(account: redis.Redis) -> None:
    guard = RedisFenceGuard(account)
    commands = [("SET", "tmp:1", "x", "EX", "60"), ("EXPIRE", "acct:1", "60", "NX"), *PAY]
    assert guard.write("account:1", FENCE, commands) == [b"OK", 1, 90, 1]
    assert 0 < account.ttl("tmp:1") <= 60


def test_an_unforeseeable_failure_says_what_was_applied_and_a_resend_applies_nothing(
    account: redis.Redis,
) -> None:
    guard = RedisFenceGuard(account)
    bad = [*PAY, ("SETBIT", "acct:1", "7", "1")]  # outside the checked commands: WRONGTYPE
    for _ in range(2):
        with pytest.raises(PartialFencedWrite) as partial:
            guard.write("account:1", FENCE, bad)
        assert partial.value.index == 3 and "WRONGTYPE" in partial.value.reason
        assert partial.value.replies == [90, 1]
        assert "commands 1..2 applied" in str(partial.value)
        assert _account(account) == (90, 1)


def test_a_write_refused_for_memory_writes_nothing(fresh_redis: RedisServer) -> None:
    client = fresh_redis.client()
    guard = RedisFenceGuard(client)
    client.hset("acct:1", "balance", 100)
    guard.write("account:1", FENCE, PAY, write_id="before")
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) // 2)
    for fence, write_id in [(FENCE + 1, ""), (FENCE, "same fence")]:
        with pytest.raises(FencedWriteRefused, match=r"the server refused it: .*maxmemory"):
            guard.write("account:1", fence, PAY, write_id=write_id)
    client.config_set("maxmemory", 0)
    assert _account(client) == (90, 1)
    assert guard.last("account:1") == FENCE
    client.close()


def test_a_client_type_that_retries_on_its_own_is_refused(redis_server: RedisServer) -> None:
    class Wrapped(redis.Redis):
        """Not a plain redis.Redis: the guard cannot bypass its retries, so it must refuse."""

    retrying = Wrapped(port=redis_server.port)
    with pytest.raises(LockError, match=r"retry=Retry\(NoBackoff\(\), 0\)"):
        RedisFenceGuard(retrying)
    plain = Wrapped(port=redis_server.port, retry=Retry(NoBackoff(), 0))
    assert RedisFenceGuard(plain).write(f"r:{uuid.uuid4().hex}", 1, [("PING",)]) == [b"PONG"]
    retrying.close()
    plain.close()


# --------------------------------------------------------------------------- SQL


@pytest.fixture(params=["sqlite_url", "pg_url"])
def engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    eng = sa.create_engine(request.getfixturevalue(request.param))
    SqlEffects(eng).create_schema()
    with eng.begin() as conn:
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS resend_ledger (entry VARCHAR(64))"))
        conn.execute(sa.text("DELETE FROM resend_ledger"))
    yield eng
    eng.dispose()


def _entries(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM resend_ledger")).scalar_one())


def test_sql_guard_alone_applies_a_retried_transaction_twice(engine: sa.Engine) -> None:
    """The control: the same fence is the same holder, so the guard accepts it again."""
    resource = f"account:{uuid.uuid4().hex}"
    for _ in range(2):  # the commit's reply was lost, so the caller runs it again
        with SqlFenceGuard().transaction(engine, resource, FENCE) as conn:
            conn.execute(sa.text("INSERT INTO resend_ledger VALUES ('pay-10')"))
    assert _entries(engine) == 2


def test_sql_effects_apply_a_retried_transaction_once(engine: sa.Engine) -> None:
    lease = MemoryBackend().try_acquire("pay:1", 30)
    assert lease is not None
    job = JobContext(key=f"pay:{uuid.uuid4().hex}", fingerprint="f" * 64, lease=lease)
    effects = SqlEffects(engine)
    results = []
    for _ in range(2):
        with effects.transaction(job, "account:1") as tx:
            if not tx.done:
                tx.conn.execute(sa.text("INSERT INTO resend_ledger VALUES ('pay-10')"))
                tx.result = {"paid": 10}
            results.append(tx.result)
    assert results == [{"paid": 10}, {"paid": 10}]
    assert _entries(engine) == 1
