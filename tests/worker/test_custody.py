"""The custody sweep's judgement on a real Redis broker (kombu's own channels and unacked
index): only a gated message that no live worker holds is put back."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from kombu import Connection, Exchange, Queue

from jobfence.worker import custody as custody_module
from jobfence.worker.custody import Custody, CustodyTimes

QUEUE = "custody-q"
GATED, PLAIN = "gated.task", "plain.task"
KEY = "jf:custody:unacked"


@pytest.fixture
def connect(redis_url: str) -> Iterator[object]:
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


def take(conn: Connection, count: int) -> object:
    """A consumer's channel holding `count` delivered, unacked messages."""
    channel = conn.channel()
    for _ in range(count):
        assert channel.basic_get(QUEUE, no_ack=False) is not None
    return channel


def custody(channel: object, worker_id: str, *, grace: float = 0.0) -> Custody:
    times = CustodyTimes(every=1.0, lifetime=60.0, grace=grace)
    return Custody(channel, worker_id=worker_id, key=KEY, times=times,
                   gated=lambda name: name == GATED)  # fmt: skip


def unacked_tasks(conn: Connection) -> list[str]:
    client = conn.default_channel.client
    return sorted(json.loads(v)[0]["headers"]["task"] for v in client.hvals("unacked"))


def test_only_a_gated_message_no_live_worker_holds_is_put_back(connect) -> None:
    setup = connect()
    publish(setup, GATED, GATED, PLAIN)
    live = take(connect(), 1)  # a live worker holds one gated message (running or prefetched)
    custody(live, "live").keep()
    take(connect(), 2)  # a worker now gone held the other gated one and the plain one
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
    assert custody(connect().channel(), "x", grace=60.0).sweep() == []  # too young to judge
    assert custody(mine, "mine").sweep() == [GATED]  # the other's, never its own
    assert unacked_tasks(setup) == [GATED]


def test_a_lapsed_record_no_longer_protects_its_worker(connect) -> None:
    setup = connect()
    publish(setup, GATED)
    held = take(connect(), 1)
    gone = custody(held, "gone")
    gone.keep()
    sweeper = custody(connect().channel(), "sweeper")
    assert sweeper.sweep() == []
    setup.default_channel.client.hset(KEY, "gone", "1 ")  # its deadline long past
    assert sweeper.sweep() == [GATED]
    assert setup.default_channel.client.hexists(KEY, "gone") == 0  # the lapsed record dropped


def test_a_sweep_pages_past_overdue_messages_it_must_leave(connect, monkeypatch) -> None:
    monkeypatch.setattr(custody_module, "SWEEP_LIMIT", 2)
    setup = connect()
    publish(setup, PLAIN, PLAIN, PLAIN, GATED)  # plain ones wait for the visibility timeout
    take(connect(), 4)  # a worker now gone
    sweeper = custody(connect().channel(), "sweeper")
    swept = [sweeper.sweep() for _ in range(3)]  # pages 0, 2, then the gated one's
    assert swept == [[], [GATED], []]
