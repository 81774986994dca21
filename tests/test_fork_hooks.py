"""A forked child never waits for a lock that a thread of its parent held at the fork."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import generate_latest

from jobfence.locks import RedisBackend
from jobfence.locks.backends.memory import MemoryBackend
from jobfence.locks.decisions import Decision, DecisionBounds, RingDecisionLog
from jobfence.locks.outage import WarningLimiter
from jobfence.tasks.metrics import Metrics
from tests.forked import CHILD_DEADLINE, run_in_child

log = logging.getLogger("tests.fork_hooks")


@contextmanager
def held_by_a_thread(*locks: Any) -> Iterator[None]:
    """`locks` held by another thread of this process until the block ends: the state a fork
    copies when it lands while that thread is inside the code they guard."""
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        taken.set()
        done.wait()
        for lock in reversed(locks):
            lock.release()

    thread = threading.Thread(target=hold, name="holder", daemon=True)
    thread.start()
    assert taken.wait(CHILD_DEADLINE)
    try:
        yield
    finally:
        done.set()
        thread.join(CHILD_DEADLINE)


def test_control_a_plain_lock_held_by_a_thread_at_the_fork_stays_held_in_the_child() -> None:
    lock = threading.Lock()

    def child() -> None:
        assert not lock.acquire(timeout=0.2)  # its holder does not exist here

    with held_by_a_thread(lock):
        assert run_in_child(child) == 0


def test_the_outage_limiter_warns_in_a_child_forked_while_a_thread_was_warning() -> None:
    limiter = WarningLimiter("lock server unavailable", burst=1)
    limiter.warning(log, "first")
    limiter.warning(log, "counted")  # suppressed: the parent's to report, not the child's

    def child() -> None:
        limiter.warning(log, "in the child")
        assert limiter.suppressed == 0

    with held_by_a_thread(limiter._lock):
        code = run_in_child(child)
    assert code is not None, f"the child hung: killed after {CHILD_DEADLINE:g}s"
    assert code == 0
    assert limiter.suppressed == 1


def test_metrics_work_in_a_child_forked_while_threads_were_recording_and_scraping() -> None:
    metrics = Metrics()
    metrics.observe_heartbeat("redis", 0.001, 1)  # the keeper's series, labelled already
    metrics.semaphore_acquired("reports", 2)
    series = metrics.heartbeat.labels("redis")
    locks = [
        metrics.heartbeat._lock,  # labels(): the keeper's lane at every extension
        series._sum._lock,  # observe()
        metrics._semaphores.lock,  # a semaphore's first name
        metrics.registry._lock,  # a scrape of /metrics
    ]

    def child() -> None:
        metrics.observe_heartbeat("redis", 0.002, 1)
        metrics.semaphore_acquired("exports", 1)
        text = generate_latest(metrics.registry).decode()
        assert 'jobfence_heartbeat_seconds_count{backend="redis"} 2.0' in text, text
        assert 'jobfence_semaphore_slots_held{semaphore="exports"} 1.0' in text, text

    with held_by_a_thread(*locks):
        code = run_in_child(child)
    assert code is not None, f"the child hung: killed after {CHILD_DEADLINE:g}s"
    assert code == 0


def test_a_redis_backend_answers_in_a_child_forked_while_a_thread_was_connecting(
    redis_url: str,
) -> None:
    """redis-py resets its pool in a child under the pool's lock, which a thread of the parent
    holds while it makes a connection (the keeper's lane, the decision log's writer)."""
    backend = RedisBackend.from_url(redis_url, prefix=f"forkhook{os.getpid()}")
    key = f"k{time.time_ns()}"

    def child() -> None:
        lease = backend.try_acquire(key, 5.0)
        assert lease is not None and lease.release()

    try:
        with held_by_a_thread(backend.client.connection_pool._lock):
            code = run_in_child(child)
        assert code is not None, f"the child hung: killed after {CHILD_DEADLINE:g}s"
        assert code == 0
    finally:
        backend.close()


def test_the_memory_backend_and_its_decision_ring_answer_in_a_child_forked_mid_write() -> None:
    """memory://'s condition and its decision ring's lock, held by a thread of the parent (the
    decision writer storing a batch, the keeper extending) when the process forks: the child's
    recorder stores and closes, its locks answer (issue 29, the long run: a forked child
    hung 10 s in close() on memory://). The control above shows a held lock stays held."""
    backend = MemoryBackend()
    ring = backend.decision_log(DecisionBounds())
    assert isinstance(ring, RingDecisionLog)
    key = f"k{time.time_ns()}"

    def child() -> None:
        ring.append_many([Decision(time.time(), "done", key, "tests.fork", "t1")])
        assert [d.task_id for d in ring.for_key(key)] == ["t1"]
        lease = backend.try_acquire(key, 5.0)
        assert lease is not None and lease.release()

    with held_by_a_thread(backend._cond, ring._lock):
        code = run_in_child(child, deadline=10.0)
    assert code is not None, "the child hung: killed after 10s"
    assert code == 0
