"""Round trips on Redis: a job that runs costs begin + commit, a replay costs one script call."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from jobfence.locks import Backoff, Lease, LeaseKeeper, RedisBackend
from jobfence.tasks import Executor, JobContext, runtime_for, singleton_task
from tests.servers import RedisServer, wait_for
from tests.tasks.conftest import AppFactory, spec_for, unique

SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "script")


@dataclass
class Traffic:
    """What clients sent to the server while a block ran (script internals excluded)."""

    commands: list[list[str]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    def names(self, scripts: dict[str, str]) -> list[str]:
        """Each command as its name; EVALSHA as `evalsha:<script name>`."""
        by_sha = {sha: name for name, sha in scripts.items()}
        out = []
        for cmd in self.commands:
            head = cmd[0].lower()
            out.append(f"evalsha:{by_sha.get(cmd[1], cmd[1])}" if head == "evalsha" else head)
        return out


def _script_calls(admin: redis.Redis) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in SCRIPT_COMMANDS}


@contextmanager
def recorded(server: RedisServer) -> Iterator[Traffic]:
    """MONITOR every command clients send while the block runs; also diff INFO commandstats."""
    admin = server.client(decode_responses=True)
    watcher = server.client(decode_responses=True, socket_timeout=5.0)
    traffic = Traffic()
    before = _script_calls(admin)
    sentinel = "jobfence-sentinel-" + uuid.uuid4().hex
    with watcher.monitor() as monitor:  # type: ignore[no-untyped-call]  # active on return
        yield traffic
        admin.echo(sentinel)
        while True:
            entry: dict[str, Any] = monitor.next_command()
            if entry["client_type"] == "lua":
                continue  # commands run inside our scripts, not round trips
            words = entry["command"].split(" ")
            if sentinel in words:
                break
            traffic.commands.append(words)
    after = _script_calls(admin)
    traffic.stats = {c: after[c] - before[c] for c in SCRIPT_COMMANDS}
    admin.close()
    watcher.close()


@pytest.fixture
def setup(redis_url: str, redis_server: RedisServer) -> Iterator[tuple[Executor, RedisBackend]]:
    backend = RedisBackend.from_url(redis_url)
    keeper = LeaseKeeper()
    executor = Executor(backend, keeper, backoff=Backoff(0.005, 0.05))
    # Warm up: open the connection and load the scripts (redis-py's Script answers a
    # NOSCRIPT with SCRIPT LOAD the first time; the fixture flushed the script cache).
    warm = spec_for(unique("warm"), ttl=60)
    executor.run(warm, lambda ctx: "warm")
    executor.run(warm, lambda ctx: "warm")
    lease = backend.begin(unique("warm"), 60)
    assert isinstance(lease, Lease)
    assert backend.extend_many([lease]) == [True]
    assert lease.release()
    yield executor, backend
    keeper.stop()
    backend.close()


def _shas(backend: RedisBackend) -> dict[str, str]:
    return {name: script.sha for name, script in backend.scripts.items()}


def test_a_job_that_runs_costs_two_round_trips(
    setup: tuple[Executor, RedisBackend], redis_server: RedisServer
) -> None:
    executor, backend = setup
    key = unique()
    with recorded(redis_server) as traffic:
        out = executor.run(spec_for(key, ttl=60), lambda ctx: {"ok": ctx.fence})
    assert out.status == "ran"
    assert traffic.names(_shas(backend)) == ["evalsha:begin", "evalsha:commit"]
    assert traffic.stats == {"evalsha": 2, "eval": 0, "evalsha_ro": 0, "eval_ro": 0, "script": 0}


def test_a_replay_costs_one_round_trip(
    setup: tuple[Executor, RedisBackend], redis_server: RedisServer
) -> None:
    executor, backend = setup
    key = unique()
    executor.run(spec_for(key, ttl=60), lambda ctx: "first")
    with recorded(redis_server) as traffic:
        out = executor.run(spec_for(key, ttl=60), lambda ctx: "second")
    assert (out.status, out.value) == ("replayed", "first")
    assert traffic.names(_shas(backend)) == ["evalsha:begin"]
    assert traffic.stats["evalsha"] == 1


def test_a_skipped_duplicate_costs_one_round_trip(
    setup: tuple[Executor, RedisBackend], redis_server: RedisServer
) -> None:
    executor, backend = setup
    key = unique()
    assert isinstance(backend.begin(key, 60), Lease)
    with recorded(redis_server) as traffic:
        out = executor.run(spec_for(key, ttl=60, on_conflict="skip"), lambda ctx: "never")
    assert out.status == "duplicate"
    assert traffic.names(_shas(backend)) == ["evalsha:begin"]


def test_keeper_extensions_are_the_only_extra_round_trips(
    setup: tuple[Executor, RedisBackend], redis_server: RedisServer
) -> None:
    executor, backend = setup
    key = unique()
    ttl = 0.3

    def outlives_ttl(ctx: JobContext) -> int:
        first = ctx.lease.deadline
        wait_for(lambda: ctx.lease.deadline > first + 2 * ttl, 10)
        return ctx.fence

    with recorded(redis_server) as traffic:
        out = executor.run(spec_for(key, ttl=ttl), outlives_ttl)
    assert out.status == "ran"
    names = traffic.names(_shas(backend))
    assert names[0] == "evalsha:begin" and names[-1] == "evalsha:commit"
    middle = names[1:-1]
    assert len(middle) >= 2 and set(middle) == {"evalsha:extend_many"}, names


def test_a_singleton_task_costs_two_round_trips(
    make_app: AppFactory, redis_server: RedisServer
) -> None:
    app = make_app(default_ttl=60, decision_log_size=0)  # the gate alone (the log: below)
    backend = runtime_for(app).backend
    assert isinstance(backend, RedisBackend)

    @singleton_task(app=app, name=unique("tests.rt"), shared=False)
    def add(a: int, b: int) -> int:
        return a + b

    add.delay(0, 0).get()  # warm up the scripts and the connection
    with recorded(redis_server) as traffic:
        assert add.delay(2, 3).get() == 5
    assert traffic.names(_shas(backend)) == ["evalsha:begin", "evalsha:commit"]
    with recorded(redis_server) as traffic:
        assert add.delay(2, 3).get() == 5
    assert traffic.names(_shas(backend)) == ["evalsha:begin"]


def test_the_decision_log_adds_one_write_after_the_job(
    make_app: AppFactory, redis_server: RedisServer
) -> None:
    """A delivery's decisions go after it, off the job's path: the process's writer thread
    sends them (flushed here), with whatever other deliveries decided meanwhile, in one
    script call (decisions_append.lua); the job itself makes its two round trips only."""
    app = make_app(default_ttl=60)
    backend = runtime_for(app).backend
    assert isinstance(backend, RedisBackend)

    @singleton_task(app=app, name=unique("tests.rt"), shared=False)
    def add(a: int, b: int) -> int:
        return a + b

    recorder = runtime_for(app).executor.recorder
    assert recorder is not None
    add.delay(0, 0).get()
    recorder.flush()
    with recorded(redis_server) as traffic:
        assert add.delay(2, 3).get() == 5
        recorder.flush()
    assert traffic.names(_shas(backend)) == [
        "evalsha:begin", "evalsha:commit", "evalsha:decisions_append",
    ]  # fmt: skip
    with recorded(redis_server) as traffic:
        assert add.delay(2, 3).get() == 5
        recorder.flush()
    assert traffic.names(_shas(backend)) == ["evalsha:begin", "evalsha:decisions_append"]
