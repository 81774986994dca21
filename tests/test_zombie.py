"""The zombie: frozen past its TTL and resumed, its fenced write is refused and leaves no trace."""

from __future__ import annotations

import multiprocessing
import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from jobfence.locks import (
    LeaseKeeper,
    RedisBackend,
    RedisFenceGuard,
    SqlFenceGuard,
    StaleFence,
)
from tests.servers import wait_for

ZOMBIE_TTL = 1.0
metadata = sa.MetaData()
accounts = sa.Table(
    "zombie_accounts",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("balance", sa.Integer, nullable=False),
)
ledger = sa.Table(
    "zombie_ledger",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("account", sa.String(64), nullable=False),
    sa.Column("writer", sa.String(16), nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)


def _sql_write(engine: sa.Engine, account: str, fence: int, balance: int, writer: str) -> None:
    """The application's fenced write: new balance plus a ledger line, in one transaction."""
    with SqlFenceGuard().transaction(engine, f"account:{account}", fence) as conn:
        conn.execute(accounts.update().where(accounts.c.id == account).values(balance=balance))
        conn.execute(ledger.insert().values(account=account, writer=writer, fence=fence))


def _redis_write(client: redis.Redis, account: str, fence: int, balance: int, writer: str) -> None:
    RedisFenceGuard(client).write(
        f"account:{account}",
        fence,
        [("HSET", f"acct:{account}", "balance", balance), ("RPUSH", f"ledger:{account}", writer)],
    )


def _zombie(lock_url: str, store: str, store_url: str, key: str, account: str, pipe: Any) -> None:
    """The first holder, in its own process: acquire, report, 'work', then write blindly."""
    try:
        backend = RedisBackend.from_url(lock_url)
        keeper = LeaseKeeper()
        lease = backend.try_acquire(key, ZOMBIE_TTL)
        if lease is None:
            raise RuntimeError("the zombie could not take the lock")
        keeper.keep(lease)  # a kept lease does not help a process that is frozen
        pipe.send(("ready", lease.fence, None))
        pipe.recv()  # the long 'work' during which it gets frozen
        try:
            if store == "redis":
                _redis_write(redis.Redis.from_url(store_url), account, lease.fence, 666, "zombie")
            else:
                _sql_write(sa.create_engine(store_url), account, lease.fence, 666, "zombie")
        except StaleFence as exc:
            pipe.send(("stale", exc.last, lease.lost))
        else:
            pipe.send(("written", None, lease.lost))
        keeper.stop()
    except BaseException as exc:
        pipe.send(("error", repr(exc), None))


class Zombie:
    """Runs `_zombie` in a spawned process and freezes it with SIGSTOP on request."""

    def __init__(self, *args: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipe, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_zombie, args=(*args, child_end), daemon=True)

    def start(self) -> int:
        self.proc.start()
        kind, fence, _ = self.recv(60)
        assert kind == "ready", fence
        return int(fence)

    def recv(self, timeout: float) -> tuple[Any, ...]:
        assert self.pipe.poll(timeout), "the zombie process did not answer"
        msg: tuple[Any, ...] = self.pipe.recv()
        if msg[0] == "error":
            pytest.fail(f"zombie failed: {msg[1]}")
        return msg

    def freeze(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Stop the process if the scenario did not run to its end."""
        if self.proc.pid is not None and self.proc.is_alive():
            self.thaw()
            self.proc.terminate()
            self.proc.join(10)


@pytest.fixture
def sql_store(request: pytest.FixtureRequest) -> Iterator[str]:
    url: str = request.getfixturevalue(request.param)
    engine = sa.create_engine(url)
    metadata.create_all(engine)
    SqlFenceGuard().create_schema(engine)
    engine.dispose()
    yield url


def _run_zombie_case(lock_url: str, store: str, store_url: str, account: str) -> tuple[int, int]:
    """Play the scenario; return (zombie fence, second holder's fence)."""
    backend = RedisBackend.from_url(lock_url)
    key = f"zombie:{account}"
    zombie = Zombie(lock_url, store, store_url, key, account)
    try:
        first = zombie.start()
        zombie.freeze()
        try:
            # Frozen past its TTL: the lock expires and a second holder takes it.
            second = wait_for(
                lambda: backend.try_acquire(key, 10.0), timeout=10.0, message="never expired"
            )
            assert second.fence > first
            if store == "redis":
                _redis_write(redis.Redis.from_url(store_url), account, second.fence, 200, "second")
            else:
                engine = sa.create_engine(store_url)
                _sql_write(engine, account, second.fence, 200, "second")
                engine.dispose()
        finally:
            zombie.thaw()
        zombie.pipe.send("write now")
        outcome, last, zombie_knew = zombie.recv(30)
        assert outcome == "stale", "the zombie's write was accepted"
        assert last == second.fence
        assert zombie_knew, "lease.lost was not set in the resumed zombie"
        zombie.proc.join(10)
        assert zombie.proc.exitcode == 0
        assert second.release()
        return first, second.fence
    finally:
        zombie.close()
        backend.close()


@pytest.mark.parametrize("sql_store", ["pg_url", "sqlite_url"], indirect=True)
def test_zombie_write_refused_on_sql(redis_url: str, sql_store: str) -> None:
    account = uuid.uuid4().hex[:12]
    engine = sa.create_engine(sql_store)
    with engine.begin() as conn:
        conn.execute(accounts.insert().values(id=account, balance=100))

    _, second = _run_zombie_case(redis_url, "sql", sql_store, account)

    with engine.connect() as conn:
        balance = conn.execute(
            sa.select(accounts.c.balance).where(accounts.c.id == account)
        ).scalar_one()
        writers = conn.execute(
            sa.select(ledger.c.writer, ledger.c.fence).where(ledger.c.account == account)
        ).all()
        assert SqlFenceGuard().last(conn, f"account:{account}") == second
    engine.dispose()
    assert balance == 200
    assert [tuple(w) for w in writers] == [("second", second)]


def test_zombie_write_refused_on_redis(redis_url: str, redis_client: redis.Redis) -> None:
    account = uuid.uuid4().hex[:12]
    redis_client.hset(f"acct:{account}", "balance", 100)

    _, second = _run_zombie_case(redis_url, "redis", redis_url, account)

    assert redis_client.hget(f"acct:{account}", "balance") == b"200"
    assert redis_client.lrange(f"ledger:{account}", 0, -1) == [b"second"]
    assert RedisFenceGuard(redis_client).last(f"account:{account}") == second
