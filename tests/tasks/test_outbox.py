"""Publish on commit (issue 34, item 1): the outbox row in the caller's transaction, the
publish after its commit, the relay for what no one sent. On a private redis-server broker
(the messages are read off its queue) and real PostgreSQL and SQLite databases."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from jobfence.config import Settings
from jobfence.tasks import ArgumentsNotSerializable, install, make_engine, singleton_task
from jobfence.tasks.effects import outbox
from jobfence.tasks.outbox import SqlOutbox, entry_for
from jobfence.worker.outbox_relay import OutboxRelay
from tests.servers import RedisServer

orders = sa.Table(
    "outbox_test_orders",
    sa.MetaData(),
    sa.Column("id", sa.String(64), primary_key=True),
)


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    url = request.getfixturevalue("pg_url" if request.param == "postgresql" else "sqlite_url")
    eng = make_engine(url)
    with eng.begin() as conn:
        orders.create(conn, checkfirst=True)
        outbox.create(conn, checkfirst=True)
        conn.execute(orders.delete())
        conn.execute(outbox.delete())
    yield eng
    eng.dispose()


@pytest.fixture
def broker(fresh_redis: RedisServer) -> RedisServer:
    """The broker: a private redis-server (the broker-down test pauses it)."""
    return fresh_redis


@pytest.fixture
def app(broker: RedisServer, redis_url: str) -> Iterator[Celery]:
    app = Celery("outbox-test", set_as_current=False)
    app.conf.update(
        broker_url=broker.url, task_serializer="json", accept_content=["json"],
        broker_connection_timeout=0.5, broker_transport_options={"socket_timeout": 0.5,
        "socket_connect_timeout": 0.5}, task_publish_retry=False,
    )  # fmt: skip
    settings = Settings(lock_url=redis_url, key_prefix=f"ob{uuid.uuid4().hex[:6]}",
                        key_secret="outbox-test-secret-not-for-production")  # fmt: skip
    runtime = install(app, settings)

    name = f"outbox.fulfil.{uuid.uuid4().hex[:8]}"  # one registration per app

    @singleton_task(app=app, name=name, key=["order"])
    def fulfil(order: str, note: str = "") -> str:
        return order

    app.conf.fulfil = name
    yield app
    runtime.close()


def fulfil(app: Celery) -> Any:
    return app.tasks[app.conf.fulfil]


def queued(broker: RedisServer) -> list[dict[str, Any]]:
    """The messages on the broker's default queue: task id, arguments, ETA."""
    client = broker.client()
    try:
        raw = client.lrange("celery", 0, -1)
    finally:
        client.close()
    out = []
    for item in raw:
        message = json.loads(item)
        headers = message["headers"]
        out.append({"id": headers["id"], "argsrepr": headers.get("argsrepr"),
                    "eta": headers.get("eta")})  # fmt: skip
    return out


def rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(outbox)))


def test_a_commit_publishes_once_and_marks_the_row_sent(
    app: Celery, engine: sa.Engine, broker: RedisServer
) -> None:
    with Session(engine) as session:
        session.execute(orders.insert().values(id="o1"))
        result = fulfil(app).apply_async_on_commit(("o1",), session=session)
        assert queued(broker) == [], "published before the commit"
        session.commit()
    assert [m["id"] for m in queued(broker)] == [result.id]
    [row] = rows(engine)
    assert row.task_id == result.id and row.sent_at is not None


def test_a_rollback_leaves_no_row_and_no_message(
    app: Celery, engine: sa.Engine, broker: RedisServer
) -> None:
    with Session(engine) as session:
        session.execute(orders.insert().values(id="o2"))
        fulfil(app).apply_async_on_commit(("o2",), session=session)
        session.rollback()
        session.execute(orders.insert().values(id="o3"))  # a later transaction commits
        session.commit()
    assert queued(broker) == [] and rows(engine) == []


def test_a_savepoint_released_is_not_the_commit(
    app: Celery, engine: sa.Engine, broker: RedisServer
) -> None:
    with Session(engine) as session:
        with session.begin_nested():
            fulfil(app).apply_async_on_commit(("o4",), session=session)
        assert queued(broker) == [], "a released savepoint is not the commit"
        session.commit()
    assert len(queued(broker)) == 1


def test_the_broker_down_at_commit_leaves_the_row_to_the_relay(
    app: Celery, engine: sa.Engine, broker: RedisServer
) -> None:
    """The control half: the publish after commit fails, nothing is queued, the row stays
    unsent (a plain on-commit publish would have lost the job here); the relay sends it."""
    broker.pause()
    try:
        with Session(engine) as session:
            result = fulfil(app).apply_async_on_commit(("o5",), session=session)
            session.commit()  # the publish times out inside; the commit stands
    finally:
        broker.resume()
    assert result.id not in [m["id"] for m in queued(broker)]
    [row] = rows(engine)
    assert row.sent_at is None
    relay = _relay(app, engine, grace=0.0)
    assert relay.relay_once() == 1
    assert [m["id"] for m in queued(broker)] == [result.id]
    assert rows(engine)[0].sent_at is not None
    assert relay.relay_once() == 0, "a sent row is not sent again"


def test_the_relay_waits_out_the_grace_and_keeps_the_countdown(
    app: Celery, engine: sa.Engine, broker: RedisServer
) -> None:
    store = SqlOutbox(engine)
    with Session(engine) as session:
        fulfil(app).apply_async_on_commit(("o6",), session=session, countdown=60)
        session.commit()
    client = broker.client()
    client.flushall()  # as if the process died before its publish: only the row is left
    client.close()
    with engine.begin() as conn:
        conn.execute(outbox.update().values(sent_at=None))
    assert _relay(app, engine, grace=30.0).relay_once() == 0, "younger than the grace"
    assert _relay(app, engine, grace=0.0).relay_once() == 1
    assert store.unsent() == 0
    [message] = queued_with_eta(broker)
    eta = datetime.fromisoformat(message)
    assert timedelta(seconds=55) < eta - datetime.now(eta.tzinfo) <= timedelta(seconds=60)


def queued_with_eta(broker: RedisServer) -> list[str]:
    """The ETAs of the scheduled messages: kombu keeps a countdown's message unacked-free in
    the queue with its `eta` header."""
    return [m["eta"] for m in queued(broker) if m["eta"]]


def test_sent_rows_are_pruned_after_the_retention(app: Celery, engine: sa.Engine) -> None:
    with Session(engine) as session:
        fulfil(app).apply_async_on_commit(("o7",), session=session)
        session.commit()
    assert SqlOutbox(engine).prune(time.time() - 3600) == 0, "sent within the retention"
    assert SqlOutbox(engine).prune(time.time() + 1) == 1 and rows(engine) == []


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda t, s: t.apply_async_on_commit(("o8",), session=s, link=None), "'link'"),
        (lambda t, s: t.apply_async_on_commit((object(),), session=s), "order"),
        (lambda t, s: t.apply_async_on_commit(("o8", "n", "extra"), session=s), "argument"),
        (lambda t, s: t.apply_async_on_commit(("o8",), session=s, eta=datetime.now()),
         "timezone-aware"),
    ],
    ids=["unknown-option", "not-json", "bad-arguments", "naive-eta"],
)
def test_a_bad_publish_is_refused_naming_it_and_writes_nothing(
    app: Celery, engine: sa.Engine, call: Any, named: str
) -> None:
    with Session(engine) as session:
        with pytest.raises((ArgumentsNotSerializable, TypeError)) as err:
            call(fulfil(app), session)
        session.commit()
    assert named in str(err.value)
    assert rows(engine) == []


def test_without_a_transaction_it_says_what_to_pass(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Outside a Django project (an earlier test on this xdist worker may have configured one).
    monkeypatch.setattr("jobfence.tasks.celery_task._django_configured", lambda: False)
    with pytest.raises(TypeError, match="session="):
        fulfil(app).apply_async_on_commit(("o9",))


def test_only_the_elected_relay_sends(app: Celery, engine: sa.Engine, broker: RedisServer) -> None:
    """Two relays of one fleet: one term at a time; the standby's loop sends nothing."""
    first, second = _relay(app, engine, grace=0.0), _relay(app, engine, grace=0.0)
    first.start()
    second.start()
    try:
        deadline = time.monotonic() + 10
        while first.elector.term is None and second.elector.term is None:
            assert time.monotonic() < deadline, "no relay was elected"
            time.sleep(0.02)
        assert not (first.elector.is_leader and second.elector.is_leader)
        # A committed row no one sent (its process died before the publish).
        with engine.begin() as conn:
            SqlOutbox(engine).write(conn, entry_for(fulfil(app), ("o10",), {}, {}, "t-o10"))
        while first.sent + second.sent == 0:
            assert time.monotonic() < deadline, "the leading relay never sent the row"
            time.sleep(0.02)
        assert SqlOutbox(engine).unsent() == 0
        assert first.sent + second.sent == 1
        leader = first if first.sent else second
        assert leader.elector.is_leader
    finally:
        first.stop()
        second.stop()


def _relay(app: Celery, engine: sa.Engine, *, grace: float) -> OutboxRelay:
    from jobfence.tasks import runtime_for

    return OutboxRelay(app, runtime_for(app), SqlOutbox(engine), grace=grace, poll=0.05,
                       retention=3600.0)  # fmt: skip



def test_a_duplicate_sent_after_commit_goes_out_to_meet_the_holder(
    broker: RedisServer, engine: sa.Engine, redis_url: str
) -> None:
    """on_duplicate_publish="raise" or "result" cannot answer a caller who has committed
    and gone: the committed copy goes out under its own task id and meets the holder at the
    gate (a typed stop naming it, or its record), so its AsyncResult never stays PENDING."""
    app = Celery("outbox-dup", set_as_current=False)
    app.conf.update(broker_url=broker.url, task_serializer="json", accept_content=["json"])
    runtime = install(app, Settings(lock_url=redis_url, key_prefix=f"od{uuid.uuid4().hex[:6]}",
                                    key_secret="outbox-test-secret-not-for-production"))
    try:
        @singleton_task(app=app, name=f"outbox.export.{uuid.uuid4().hex[:8]}",
                        dedupe_on_publish=True, on_duplicate_publish="raise")
        def export(report: str) -> str:
            return report

        first = export.delay("r1")  # queued: holds the publish claim
        with Session(engine) as session:
            later = export.apply_async_on_commit(("r1",), session=session)
            session.commit()  # no DuplicatePublish here, with no caller to take it
        assert sorted(m["id"] for m in queued(broker)) == sorted([first.id, later.id])
        assert rows(engine)[0].sent_at is not None
    finally:
        runtime.close()


def test_a_row_that_cannot_be_sent_does_not_hold_up_the_rest(
    app: Celery, engine: sa.Engine, broker: RedisServer
) -> None:
    """A row broken in the table (its payload edited by hand) is counted and left; the row
    behind it still goes out (a broker that is down instead ends the look)."""
    store = SqlOutbox(engine)
    with engine.begin() as conn:
        store.write(conn, entry_for(fulfil(app), ("o11",), {}, {}, "t-broken"))
        store.write(conn, entry_for(fulfil(app), ("o12",), {}, {}, "t-fine"))
        conn.execute(outbox.update().where(outbox.c.task_id == "t-broken")
                     .values(payload="{not json", created_at=0.0))  # fmt: skip
    assert _relay(app, engine, grace=0.0).relay_once() == 1
    assert [m["id"] for m in queued(broker)] == ["t-fine"]
    with engine.connect() as conn:
        broken = conn.execute(sa.select(outbox).where(outbox.c.task_id == "t-broken")).one()
    assert broken.sent_at is None and broken.attempts == 1


def test_a_long_lived_session_keeps_one_pair_of_listeners(
    app: Celery, engine: sa.Engine, broker: RedisServer
) -> None:
    """A batch script publishing in transaction after transaction with one Session: each
    commit publishes its own message once, and the Session's listeners do not pile up."""
    with Session(engine) as session:
        for i in range(30):
            fulfil(app).apply_async_on_commit((f"b{i}",), session=session)
            if i % 3:
                session.commit()
            else:
                session.rollback()
        assert len(session.dispatch.after_commit) == 1
    assert len(queued(broker)) == 20 and len(rows(engine)) == 20
