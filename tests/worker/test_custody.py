"""The custody sweep's judgement on a real Redis broker (kombu's own channels and unacked
index): only a gated message that no live worker holds is put back, once its own task's TTL
has passed, and as a new delivery with a tag of its own."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

import jobfence
from jobfence.config import Settings
from jobfence.tasks import singleton_task
from jobfence.tasks.runtime import installed
from jobfence.worker import custody as custody_module
from jobfence.worker.custody import Custody, CustodyTimes
from tests.servers import wait_for

QUEUE = "custody-q"
GATED, PLAIN = "gated.task", "plain.task"
KEY = "jf:custody:unacked"
TTL = 60.0  # the gated task's lease TTL in the hand-built custodies


@pytest.fixture
def connect(redis_url: str) -> Iterator[Any]:
    made: list[Connection] = []

    def connection() -> Connection:
        conn = Connection(redis_url)
        made.append(conn)
        return conn

    yield connection
    for conn in made:
        conn.release()


def publish(conn: Connection, *names: str) -> None:
    queue = Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE)
    with conn.Producer() as producer:
        for i, name in enumerate(names):
            producer.publish(
                {"n": i}, exchange=queue.exchange, routing_key=QUEUE, declare=[queue],
                headers={"task": name, "id": f"{name}-{i}"}, serializer="json",
            )  # fmt: skip


def take(conn: Connection, count: int) -> Any:
    """A consumer's channel holding `count` delivered, unacked messages."""
    channel = conn.channel()
    for _ in range(count):
        assert channel.basic_get(QUEUE, no_ack=False) is not None
    return channel


def held_tags(channel: Any) -> list[str]:
    return list(channel.qos._delivered)


def custody(channel: Any, worker_id: str, *, grace: float = 0.0) -> Custody:
    times = CustodyTimes(every=1.0, lifetime=TTL, grace=grace)
    return Custody(channel, worker_id=worker_id, key=KEY, times=times,
                   lease_ttl={GATED: TTL}.get)  # fmt: skip


def age(conn: Connection, seconds: float) -> None:
    """Every unacked delivery now dates from `seconds` earlier (kombu's index: tag -> time)."""
    client = conn.default_channel.client
    for tag, at in client.zrange("unacked_index", 0, -1, withscores=True):
        client.zadd("unacked_index", {tag: at - seconds})


def unacked_tasks(conn: Connection) -> list[str]:
    client = conn.default_channel.client
    return sorted(json.loads(v)[0]["headers"]["task"] for v in client.hvals("unacked"))


def unacked(conn: Connection, tag: str) -> tuple[bool, bool]:
    """(in kombu's unacked hash, in its unacked index) for `tag`."""
    client = conn.default_channel.client
    return bool(client.hexists("unacked", tag)), client.zscore("unacked_index", tag) is not None


def test_only_a_gated_message_no_live_worker_holds_is_put_back(connect) -> None:
    setup = connect()
    publish(setup, GATED, GATED, PLAIN)
    live = take(connect(), 1)  # a live worker holds one gated message (running or prefetched)
    custody(live, "live").keep()
    take(connect(), 2)  # a worker now gone held the other gated one and the plain one
    age(setup, 2 * TTL)
    sweeper = custody(connect().channel(), "sweeper")
    assert sweeper.sweep() == [GATED]
    assert unacked_tasks(setup) == [GATED, PLAIN]  # the live worker's, and the plain task's
    back = setup.default_channel.client.lrange(QUEUE, 0, -1)
    assert [json.loads(m)["headers"]["task"] for m in back] == [GATED]
    assert json.loads(back[0])["headers"]["redelivered"] is True
    assert sweeper.sweep() == []  # put back once


def test_a_sweep_leaves_young_deliveries_and_its_own_alone(connect) -> None:
    setup = connect()
    publish(setup, GATED, GATED)
    mine = take(connect(), 1)  # held here, not recorded yet
    take(connect(), 1)
    assert custody(connect().channel(), "x", grace=TTL).sweep() == []  # too young to judge
    assert custody(connect().channel(), "x").sweep() == []  # younger than its task's TTL
    age(setup, 2 * TTL)
    assert custody(mine, "mine").sweep() == [GATED]  # the other's, never its own
    assert unacked_tasks(setup) == [GATED]


def test_a_lapsed_record_no_longer_protects_its_worker(connect) -> None:
    setup = connect()
    publish(setup, GATED)
    held = take(connect(), 1)
    gone = custody(held, "gone")
    gone.keep()
    age(setup, 2 * TTL)
    sweeper = custody(connect().channel(), "sweeper")
    assert sweeper.sweep() == []
    setup.default_channel.client.hset(KEY, "gone", "1 ")  # its deadline long past
    assert sweeper.sweep() == [GATED]
    assert setup.default_channel.client.hexists(KEY, "gone") == 0  # the lapsed record dropped


def test_a_tag_of_an_older_releases_record_is_held_until_the_records_deadline(connect) -> None:
    setup = connect()
    publish(setup, GATED)
    (tag,) = held_tags(take(connect(), 1))
    age(setup, 2 * TTL)
    client = setup.default_channel.client
    client.hset(KEY, "older", f"{int(time.time() * 1000) + 60_000} {tag}")  # bare tags
    assert custody(connect().channel(), "sweeper").sweep() == []


def test_a_sweep_pages_past_overdue_messages_it_must_leave(connect, monkeypatch) -> None:
    monkeypatch.setattr(custody_module, "SWEEP_LIMIT", 2)
    setup = connect()
    publish(setup, PLAIN, PLAIN, PLAIN, GATED)  # plain ones wait for the visibility timeout
    take(connect(), 4)  # a worker now gone
    age(setup, 2 * TTL)
    sweeper = custody(connect().channel(), "sweeper")
    swept = [sweeper.sweep() for _ in range(3)]  # pages 0, 2, then the gated one's
    assert swept == [[], [GATED], []]


# -- a put-back is a new delivery (issue 29, defect 1; design section 10) -------------------


def paused_holder_and_its_successor(connect: Any, put_back: Any) -> tuple[Any, Any, str, str]:
    """A holds the gated message under tag T, past its TTL; `put_back(sweeper, T)` puts it
    back; B takes the copy. Returns (A's channel, B's channel, T, B's tag)."""
    setup = connect()
    publish(setup, GATED)
    first = take(connect(), 1)
    (old,) = held_tags(first)
    age(setup, 2 * TTL)
    put_back(custody(connect().channel(), "sweeper"), old)
    second = take(connect(), 1)
    (new,) = held_tags(second)
    return first, second, old, new


def test_a_put_back_message_carries_a_fresh_tag_and_the_old_holders_ack_spares_it(
    connect,
) -> None:
    first, second, old, new = paused_holder_and_its_successor(
        connect, lambda sweeper, tag: sweeper.sweep()
    )
    assert new != old
    assert unacked(connect(), old) == (False, False)  # gone with the put-back, atomically
    first.basic_ack(old)  # the superseded holder ends and acks what it holds
    assert unacked(connect(), new) == (True, True)  # the new holder's entry is untouched
    second.basic_reject(new, requeue=True)  # its pool child dies: Celery requeues the copy
    assert take(connect(), 1) is not None  # and the job is still there to run


def test_control_a_put_back_under_the_same_tag_loses_the_job_to_the_old_holders_ack(
    connect,
) -> None:
    first, second, old, new = paused_holder_and_its_successor(
        connect,
        lambda sweeper, tag: sweeper.qos.restore_by_tag(tag),  # kombu's own, as on main
    )
    assert new == old
    first.basic_ack(old)
    assert unacked(connect(), new) == (False, False)  # the new holder's entry went with it
    second.basic_reject(new, requeue=True)
    assert connect().channel().basic_get(QUEUE, no_ack=False) is None  # lost


def test_a_message_its_new_holder_keeps_is_never_put_back_again(connect) -> None:
    first, second, _, new = paused_holder_and_its_successor(
        connect, lambda sweeper, tag: sweeper.sweep()
    )
    custody(first, "resumed").keep()  # the old holder, back, still lists the old tag
    custody(second, "successor").keep()
    age(connect(), 2 * TTL)
    assert custody(connect().channel(), "sweeper").sweep() == []
    assert custody(first, "resumed").sweep() == []
    assert unacked(connect(), new) == (True, True)


def test_a_put_back_of_a_message_acked_meanwhile_puts_nothing_back(connect) -> None:
    setup = connect()
    publish(setup, GATED)
    holder = take(connect(), 1)
    (tag,) = held_tags(holder)
    holder.basic_ack(tag)
    assert custody(connect().channel(), "sweeper").put_back(tag) is False
    assert setup.default_channel.client.llen(QUEUE) == 0


# -- a delivery's custody lasts its task's own TTL (issue 29, defect 9) ---------------------

DEFAULT_TTL, TASK_TTL = 30.0, 0.5


def echo(n: int) -> int:
    return n


@pytest.fixture
def app_with_a_short_task(redis_url: str) -> Iterator[Celery]:
    """A `setup` app on the broker: default lease TTL 30 s, one task declared `ttl=0.5`."""
    app = Celery("custody-ttl", broker=redis_url, set_as_current=False)
    jobfence.setup(app, Settings(lock_url=redis_url, default_ttl=DEFAULT_TTL,
                                 visibility_timeout=120.0))  # fmt: skip
    singleton_task(app=app, name=GATED, shared=False, ttl=TASK_TTL)(echo)
    singleton_task(app=app, name="long.task", shared=False)(echo)
    yield app
    runtime = installed(app)
    if runtime is not None:
        runtime.close()


def worker_custody(app: Celery, conn: Connection, name: str) -> Custody:
    """The custody a worker of `app` builds for a consumer on `conn` (custody.build)."""
    consumer = SimpleNamespace(app=app, hostname=name,
                               task_consumer=SimpleNamespace(channel=conn.channel()))  # fmt: skip
    built = custody_module.build(consumer)
    assert built is not None
    return built


def test_a_worker_records_each_delivery_for_its_tasks_ttl(app_with_a_short_task, connect) -> None:
    app = app_with_a_short_task
    publish(connect(), GATED, "long.task")
    conn = connect()
    holder = worker_custody(app, conn, "holder")
    for _ in range(2):
        assert holder.channel.basic_get(QUEUE, no_ack=False) is not None
    assert holder.times.every <= TASK_TTL / 3  # recorded often enough for its shortest TTL
    holder.keep()
    client = connect().default_channel.client
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    (record,) = client.hvals(holder.custody_key)
    deadlines = dict(token.split("=") for token in record.decode().split()[1:])
    names = {tag: m.headers["task"] for tag, m in holder.qos._delivered.items()}
    lasts = {names[tag]: (int(ms) - now_ms) / 1000 for tag, ms in deadlines.items()}
    assert lasts[GATED] <= TASK_TTL + 0.1  # its own TTL, far below the default's
    assert DEFAULT_TTL - 1.0 <= lasts["long.task"] <= DEFAULT_TTL + 0.1


def test_a_gone_workers_job_is_put_back_after_its_tasks_ttl_not_the_default(
    app_with_a_short_task, connect
) -> None:
    app = app_with_a_short_task
    publish(connect(), GATED)
    holder = worker_custody(app, connect(), "holder")
    assert holder.channel.basic_get(QUEUE, no_ack=False) is not None
    holder.keep()  # its last record: the worker is gone after this
    sweeper = worker_custody(app, connect(), "sweeper")
    # Back within a bound far above the task's TTL (0.5 s) and far below the default (30 s).
    assert wait_for(sweeper.sweep, DEFAULT_TTL / 3, interval=0.1) == [GATED]
