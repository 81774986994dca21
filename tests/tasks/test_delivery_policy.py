"""The delivery policy on a real Redis: nothing lost, nothing twice when the lock server fails.

A message is acked only on DONE, on a final FAILED, or for a duplicate while a live holder
runs the job; a stall before the body, a lease lost with no proof of a newer holder, and a
commit whose reply was lost come back (same key) instead of being dropped or failed.
Each fault test has its control: the same fault shown to bite (the naive outcome).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery.exceptions import Ignore

from jobfence.config import Settings
from jobfence.locks import (
    BackendUnavailable,
    Backoff,
    Lease,
    LeaseKeeper,
    MemoryBackend,
    RedisBackend,
)
from jobfence.tasks import (
    DROPPED,
    Executor,
    JobContext,
    Outcome,
    Redelivery,
    Runtime,
    SqlEffects,
    install,
    singleton_task,
)
from jobfence.tasks.celery_task import HEADER
from jobfence.tasks.errors import JobNotSettled
from jobfence.tasks.flow.marks import REDELIVERIES_HEADER as REDELIVERIES
from tests.proxy import FaultProxy, ReplyRule, evalsha
from tests.servers import RedisServer, wait_for
from tests.tasks.conftest import AppFactory, spec_for, sql_effects, unique

# --------------------------------------------------------------------------- helpers


@pytest.fixture
def stall_keeper() -> Iterator[LeaseKeeper]:
    k = LeaseKeeper()
    yield k
    k.stop()


def _executor(backend: Any, keeper: LeaseKeeper) -> Executor:
    return Executor(
        backend, keeper, backoff=Backoff(0.005, 0.05), redelivery=Redelivery(base=0.05, cap=0.2)
    )


def _until_settled(
    executor: Executor, key: str, body: Callable[[JobContext], Any], **spec: Any
) -> list[Outcome]:
    """Deliver the job as a broker would: again after each `redeliver`, at most ten times."""
    outcomes = [executor.run(spec_for(key, **spec), body)]
    while outcomes[-1].status == "redeliver" and len(outcomes) < 10:
        outcomes.append(executor.run(spec_for(key, redeliveries=len(outcomes), **spec), body))
    return outcomes


# --------------------------------------------------------------------------- begin during a stall


def test_a_stall_during_begin_redelivers_instead_of_failing(
    fresh_redis: RedisServer, stall_keeper: LeaseKeeper
) -> None:
    backend = RedisBackend.from_url(fresh_redis.url, socket_timeout=0.3)
    executor = _executor(backend, stall_keeper)
    key = unique()
    runs: list[int] = []

    def body(ctx: JobContext) -> int:
        runs.append(ctx.fence)
        return ctx.fence

    fresh_redis.pause()  # a 0.6 s stall of the lock server
    stalled_at = time.monotonic()
    try:
        # Control: the same stall fails a plain begin (the old executor let this through
        # as the task's FAILURE, and the message was acked with the body never run).
        with pytest.raises(BackendUnavailable):
            backend.begin(unique("control"), 30)
        out = executor.run(spec_for(key), body)
        time.sleep(max(0.0, 0.6 - (time.monotonic() - stalled_at)))  # the rest of the stall
    finally:
        fresh_redis.resume()
    assert out.status == "redeliver" and runs == [], out
    assert 0 < out.countdown <= 0.2 and "unavailable" in out.reason
    again = executor.run(spec_for(key, redeliveries=1), body)
    assert again.status == "ran" and runs == [again.fence]
    record = backend.job_record(key)
    assert record is not None and record.state == "DONE"
    backend.close()


# --------------------------------------------------------------------------- lost commit reply


def test_a_lost_commit_reply_reports_success(
    redis_server: RedisServer, redis_url: str, stall_keeper: LeaseKeeper
) -> None:
    proxy = FaultProxy(redis_server.host, redis_server.port).start()
    backend = RedisBackend.from_url(proxy.url, socket_timeout=0.3)
    executor = _executor(backend, stall_keeper)
    commit = evalsha(backend.scripts["commit"].sha)
    try:
        # Load every script first (the reply to drop must be the commit's, not NOSCRIPT's).
        assert executor.run(spec_for(unique("warm-up")), lambda ctx: None).status == "ran"
        # Control: a commit whose reply is lost raises, though the server stored it.
        lease = backend.begin(unique("control"), 30, record=True)
        assert isinstance(lease, Lease)
        control_drop = proxy.drop_reply(match=commit)
        with pytest.raises(BackendUnavailable):
            backend.commit(lease, state="DONE", result="1", fingerprint="f", result_ttl=60)
        assert control_drop.fired.wait(10)  # the reply came back, and was swallowed
        control = backend.job_record(lease.key)
        assert control is not None and control.state == "DONE"

        key = unique()
        runs: list[int] = []
        drops: list[ReplyRule] = []

        def body(ctx: JobContext) -> dict[str, int]:
            runs.append(ctx.fence)
            drops.append(proxy.drop_reply(match=commit))  # the commit's reply
            return {"charged": 100}

        out = executor.run(spec_for(key), body)
        assert len(drops) == 1 and drops[0].fired.wait(10), (
            "the commit's reply was not dropped: the fault did not bite"
        )
        assert (out.status, out.value) == ("ran", {"charged": 100})
        assert runs == [out.fence]
        record = backend.job_record(key)
        assert record is not None and record.state == "DONE" and record.fence == out.fence
        assert backend.inspect(key) is None
    finally:
        backend.close()
        proxy.stop()


# --------------------------------------------------------------------------- restart mid-body

effects_meta = sa.MetaData()
effects_table = sa.Table(
    "policy_effects",
    effects_meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_key", sa.String(255), nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)


@pytest.fixture
def effects(sqlite_url: str) -> Iterator[SqlEffects]:
    with sql_effects(sqlite_url, effects_meta) as fx:
        yield fx


def _effect_rows(fx: SqlEffects, key: str) -> list[int]:
    with fx.engine.connect() as conn:
        rows = conn.execute(
            sa.select(effects_table.c.fence).where(effects_table.c.job_key == key)
        )
        return [r.fence for r in rows]


def _restarting_body(
    server: RedisServer, fx: SqlEffects, effect_first: bool
) -> Callable[[JobContext], Any]:
    """First run: (effect,) the lock server restarts with all data lost, wait for the loss."""
    runs: list[int] = []

    def effect(ctx: JobContext) -> Any:
        with fx.transaction(ctx, f"job:{ctx.key}") as tx:
            if not tx.done:
                tx.conn.execute(effects_table.insert().values(job_key=ctx.key, fence=ctx.fence))
                tx.result = {"fence": ctx.fence}
        return tx.result

    def body(ctx: JobContext) -> Any:
        runs.append(ctx.fence)
        if len(runs) == 1:
            result = effect(ctx) if effect_first else None
            server.restart()  # every key gone: the lock, the fence counter
            wait_for(lambda: ctx.lease.lost, 10.0, message="the keeper never saw the loss")
            ctx.check()  # raises LeaseLost: the body stops here
            return result
        return effect(ctx)

    body.runs = runs  # type: ignore[attr-defined]
    return body


@pytest.mark.parametrize("effect_first", [False, True], ids=["effect-after", "effect-before"])
def test_lock_server_losing_its_data_mid_body_redelivers_and_the_effect_happens_once(
    fresh_redis: RedisServer,
    stall_keeper: LeaseKeeper,
    effects: SqlEffects,
    effect_first: bool,
) -> None:
    backend = RedisBackend.from_url(fresh_redis.url, socket_timeout=0.3)
    executor = _executor(backend, stall_keeper)
    key = unique()
    body = _restarting_body(fresh_redis, effects, effect_first)
    outcomes = _until_settled(executor, key, body, ttl=0.9)
    assert [o.status for o in outcomes] == ["redeliver", "ran"], outcomes
    assert "without proof" in outcomes[0].reason
    rows = _effect_rows(effects, key)
    assert len(rows) == 1, rows  # the job was not dropped, and took effect once
    runs: list[int] = body.runs  # type: ignore[attr-defined]
    assert len(runs) == 2 and runs[1] > runs[0]  # fences keep increasing across the loss
    assert rows == [runs[0] if effect_first else runs[1]]
    assert outcomes[-1].value == {"fence": rows[0]}
    record = backend.job_record(key)
    assert record is not None and record.state == "DONE"
    backend.close()


def test_control_the_old_policy_drops_the_job_when_the_lock_server_loses_its_data(
    fresh_redis: RedisServer, stall_keeper: LeaseKeeper, effects: SqlEffects
) -> None:
    """The same fault under at-most-once (what every lost lease used to get): the job is lost."""
    backend = RedisBackend.from_url(fresh_redis.url, socket_timeout=0.3)
    executor = _executor(backend, stall_keeper)
    key = unique()
    body = _restarting_body(fresh_redis, effects, effect_first=False)
    outcomes = _until_settled(executor, key, body, ttl=0.9, on_lease_lost="drop")
    assert [(o.status, o.value) for o in outcomes] == [("dropped", DROPPED)]
    assert _effect_rows(effects, key) == []  # acked, never run to its effect: lost
    assert backend.job_record(key) is None
    backend.close()


# --------------------------------------------------------------------------- the Celery side


class UnreachableBackend(MemoryBackend):
    """The lock server does not answer: every begin times out."""

    def _begin(self, *args: Any) -> Any:
        raise BackendUnavailable("timed out (test)")


def _unreachable_app(make_app: AppFactory, redis_url: str, *, eager: bool) -> Any:
    app = make_app(eager=eager, installed=False)
    settings = Settings(lock_url=redis_url, redelivery_delay=0.5)
    runtime = install(app, Runtime(settings, backend=UnreachableBackend()))
    return app, runtime


def _identity(x: int) -> int:
    return x


def test_on_lease_lost_is_validated_at_decoration(make_app: AppFactory) -> None:
    app = make_app()
    with pytest.raises(ValueError, match="on_lease_lost must be one of"):
        singleton_task(app=app, on_lease_lost="ignore")(_identity)  # type: ignore[arg-type]
    task = singleton_task(app=app, name=unique("t"), on_lease_lost="drop")(_identity)
    assert task.on_lease_lost == "drop"


def test_eager_call_with_the_lock_server_down_raises_not_settled(
    make_app: AppFactory, redis_url: str
) -> None:
    app, runtime = _unreachable_app(make_app, redis_url, eager=True)
    task = singleton_task(app=app, name=unique("t"))(_identity)
    with pytest.raises(JobNotSettled, match="unavailable"):
        task.delay(1)
    runtime.close()


def test_redelivery_republishes_the_same_message_counted_apart_from_retries(
    make_app: AppFactory, redis_url: str, redis_client: Any
) -> None:
    """As a worker would run it: the lock server is down, the message comes back later."""
    import json

    app, runtime = _unreachable_app(make_app, redis_url, eager=False)
    task = singleton_task(app=app, name=unique("t"), max_retries=3)(_identity)
    task.push_request(
        id="task-1",
        args=[1],
        kwargs={},
        retries=2,
        headers={HEADER: "order-9", REDELIVERIES: 4},
        delivery_info={"exchange": "", "routing_key": "celery"},
        called_directly=False,
        is_eager=False,
    )
    try:
        with pytest.raises(Ignore):  # this copy is acked: a new one is on the broker
            task._gated((1,), {})
    finally:
        task.pop_request()
    assert redis_client.llen("celery") == 1
    message = json.loads(redis_client.lindex("celery", 0))
    headers = message["headers"]
    assert headers["id"] == "task-1" and headers["retries"] == 2  # user's retries untouched
    assert headers[HEADER] == "order-9" and headers[REDELIVERIES] == 5
    assert headers["eta"] is not None  # with a countdown (backoff), not at once
    runtime.close()
