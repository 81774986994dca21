"""Row a: the reply to an acquire is lost after the lock server executed it.

Fault: a TCP proxy between the worker and a private redis-server lets the acquire command
through, the server grants the lock, and the proxy then drops the reply, holds it past
the client's socket timeout, or resets the connection instead of sending it. The client
cannot tell this from a request that never arrived.

Control: a naive lock (SET NX PX with redis-py's default client, which re-sends a command
after a timeout) reports "not acquired" for a lock the server granted to it: its own
re-sent SET NX finds the key taken. The task is skipped and the lock is held by nobody
until its TTL runs out.

jobfence: the grant the client never saw is never extended (the keeper only keeps leases
it was handed), so it is gone within its TTL; while it lives, nobody else holds the job
(other deliveries see it busy), and the job's own redelivery runs it once afterwards, or
at once if the backend recovers its own grant. One holder at a time, one effect, no lock
outliving its TTL.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from jobfence.locks.acquire import Backoff
from jobfence.locks.backends.redis import RedisBackend
from jobfence.locks.errors import LockError
from jobfence.locks.keeper import LeaseKeeper
from jobfence.tasks.context import JobContext
from jobfence.tasks.executor import Executor, JobSpec
from tests.proxy import FaultProxy, ReplyRule, command, evalsha
from tests.servers import RedisServer, wait_for

pytestmark = pytest.mark.fault

TTL = 1.5  # seconds: the orphaned grant must be gone this long after it was made
SOCKET_TIMEOUT = 0.3
SLACK = 5.0  # generous headroom for a loaded box
NAIVE_TTL_MS = 30_000  # the control never waits for it: long, so a slow box still sees it


def inject(proxy: FaultProxy, fault: str, match: Callable[[list[bytes]], bool]) -> ReplyRule:
    if fault == "drop":
        return proxy.drop_reply(match=match)
    if fault == "delay":  # longer than the socket timeout: the client gave up before it came
        return proxy.delay_reply(SOCKET_TIMEOUT * 4, match=match)
    return proxy.reset_after_reply(match=match)


FAULTS = ["drop", "delay", "reset"]


# --------------------------------------------------------------------------- control


@pytest.mark.parametrize("fault", FAULTS)
def test_control_naive_lock_loses_a_granted_acquire(
    fresh_redis: RedisServer, fault_proxy: FaultProxy, fault: str
) -> None:
    key = "naive:lock:a"
    rule = inject(fault_proxy, fault, command("SET", key))
    # The naive worker: redis-py's defaults (re-send on timeout and connection errors).
    naive = redis.Redis(host=fault_proxy.host, port=fault_proxy.port, socket_timeout=0.3)
    token = secrets.token_hex(8)
    ran: list[str] = []
    try:
        try:
            acquired = naive.set(key, token, nx=True, px=NAIVE_TTL_MS)
        except redis.RedisError:  # the re-sent SET timed out too (a loaded box): not acquired
            acquired = None
        if acquired:
            ran.append("body")
    finally:
        naive.close()
    assert rule.fired.is_set(), "the fault did not fire: the control proves nothing"
    server = fresh_redis.client()
    # The server granted the lock to this very client, which believes it lost the race:
    assert not acquired
    assert ran == []
    assert server.get(key) == token.encode()
    assert 0 < server.pttl(key) <= NAIVE_TTL_MS  # held by nobody until the TTL ends


# --------------------------------------------------------------------------- jobfence


@pytest.fixture
def keeper() -> Iterator[LeaseKeeper]:
    keeper = LeaseKeeper()
    yield keeper
    keeper.stop()


def deliver(
    executor: Executor, spec: JobSpec, body: Callable[[JobContext], Any], timeout: float
) -> list[str]:
    """Deliver `spec` again and again, as the broker would redeliver an unacked message,
    until it runs or replays; returns every delivery's status (or error name)."""
    deadline = time.monotonic() + timeout
    statuses: list[str] = []
    while True:
        pause = 0.05
        try:
            outcome = executor.run(spec, body)
        except LockError as exc:  # the message is not acked: it comes back
            statuses.append(type(exc).__name__)
        else:
            statuses.append(outcome.status)
            if outcome.status in ("ran", "replayed"):
                return statuses
            if outcome.status not in ("defer", "retry", "redeliver"):
                raise AssertionError(f"the job was given up: {statuses}")
            pause = min(max(outcome.countdown, 0.01), 0.2)
        if time.monotonic() > deadline:
            raise AssertionError(f"job not done after {timeout:.0f}s: {statuses}")
        time.sleep(pause)  # the redelivery delay, not a synchronisation


def deliver_once(executor: Executor, spec: JobSpec, body: Callable[[JobContext], Any]) -> str:
    """The first delivery, through the fault: its status, or the error it raised."""
    try:
        return executor.run(spec, body).status
    except LockError as exc:
        return type(exc).__name__


@pytest.mark.parametrize("fault", FAULTS)
def test_lost_begin_reply_leaves_one_holder_and_no_orphan(
    fresh_redis: RedisServer, fault_proxy: FaultProxy, keeper: LeaseKeeper, fault: str
) -> None:
    worker = RedisBackend.from_url(fault_proxy.url, socket_timeout=SOCKET_TIMEOUT)
    other = RedisBackend.from_url(fresh_redis.url)
    store = fresh_redis.client(decode_responses=True)
    key = "job:row-a"
    spec = JobSpec(
        name="row_a", key=key, fingerprint="fp", ttl=TTL, result_ttl=60, task_id="task-1"
    )
    duplicate = JobSpec(
        name="row_a", key=key, fingerprint="fp", ttl=TTL, result_ttl=60, task_id="task-2"
    )
    seen: list[tuple[int, int | None]] = []  # (the body's fence, the lock's fence on the server)

    def body(job: JobContext) -> str:
        info = other.inspect(key)  # one holder: while a body runs, the lock is its own
        seen.append((job.fence, info.fence if info is not None else None))
        store.rpush("effects", job.fence)
        return "charged"

    rule = inject(fault_proxy, fault, evalsha(worker.scripts["begin"].sha))
    executor = Executor(worker, keeper, backoff=Backoff())
    elsewhere = Executor(other, keeper, backoff=Backoff())
    try:
        started = time.monotonic()
        first = deliver_once(executor, spec, body)
        assert rule.fired.is_set(), "the fault did not fire"
        orphan = other.inspect(key)
        if first == "ran":  # the backend recovered its own grant: nothing left behind
            assert orphan is None
        elif orphan is None:
            # Only a box too loaded to look within the TTL gets here: it expired unextended.
            assert time.monotonic() - started >= TTL
            statuses = deliver(executor, spec, body, timeout=TTL + 2 * SLACK)
            assert statuses[-1] == "ran"
        else:
            # The server holds a grant whose owner token the worker never learnt.
            assert orphan is not None and orphan.task_id == "task-1"
            assert orphan.ttl_left <= TTL
            # While it lives nobody else runs the job: another delivery sees it busy.
            assert elsewhere.run(duplicate, body).status == "duplicate"
            # Never extended: it is gone within its TTL of the grant.
            wait_for(lambda: other.inspect(key) is None, TTL + SLACK, message="orphan lives on")
            assert time.monotonic() - started < TTL + SLACK
            statuses = deliver(executor, spec, body, timeout=TTL + 2 * SLACK)
            assert statuses[-1] == "ran"
        assert len(seen) == 1 and seen[0][0] == seen[0][1], seen
        assert len(store.lrange("effects", 0, -1)) == 1  # one effect
        assert other.job_record(key) is not None  # DONE: a later delivery replays it
        assert other.inspect(key) is None
        assert elsewhere.run(duplicate, body).status == "replayed"
        assert len(store.lrange("effects", 0, -1)) == 1
    finally:
        worker.close()
        other.close()
