"""The Celery benchmark's app: one trivial task per contender, all on one broker and fleet."""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery, signals
from celery_once import QueueOnce
from celery_singleton import Singleton

from jobfence.config import Settings
from jobfence.tasks import install, singleton_task

# The bench sets this to its private redis-server (redis://127.0.0.1:PORT) before it imports
# this module and in the environment of every worker it starts.
URL_ENV = "JOBFENCE_BENCH_REDIS_URL"
BASE_URL = os.environ.get(URL_ENV, "redis://127.0.0.1:6379").rstrip("/")
# Milliseconds every body waits before it counts (time.sleep: I/O wait, no CPU); 0: trivial.
BODY_ENV = "JOBFENCE_BENCH_BODY_MS"
BODY_SECONDS = float(os.environ.get(BODY_ENV) or 0) / 1000
BROKER_URL = f"{BASE_URL}/0"
RESULT_URL = f"{BASE_URL}/2"
# The lock server (jobfence's, celery-once's and celery-singleton's locks) and the bench's
# counters: by default each a private redis-server of its own, so that each server's CPU per
# job is measured apart (issue 33); unset (`--one-server`), databases 1 of the broker's.
LOCK_ENV = "JOBFENCE_BENCH_LOCK_URL"
COUNTER_ENV = "JOBFENCE_BENCH_COUNTER_URL"
LOCK_URL = os.environ.get(LOCK_ENV) or f"{BASE_URL}/1"
COUNTER_URL = os.environ.get(COUNTER_ENV) or LOCK_URL

EXEC_PREFIX = "cbench:exec:"  # + tag: task bodies run
HANDLED_PREFIX = "cbench:handled:"  # + tag: deliveries finished (storm tags only)
READY_KEY = "cbench:ready"  # workers ready to consume
STORM_TAG = "storm-"
LOCK_TIMEOUT = 600  # seconds: celery-once and celery-singleton lock expiry

app = Celery("cbench", broker=BROKER_URL, backend=RESULT_URL)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,  # every task below also says ignore_result=True
    task_acks_late=True,  # jobfence's default, given to all four alike
    task_reject_on_worker_lost=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": LOCK_URL, "default_timeout": LOCK_TIMEOUT},
    },
    singleton_backend_url=LOCK_URL,
    singleton_key_prefix="cbench-singleton:",
    singleton_lock_expiry=LOCK_TIMEOUT,
)
install(app, Settings(lock_url=LOCK_URL, key_prefix="cbench-jobfence"))

_client: redis.Redis | None = None
_client_pid = 0


def counters() -> redis.Redis:
    """A client for the counters, one per process (workers fork after import)."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        _client = redis.Redis.from_url(COUNTER_URL, socket_timeout=5.0)
        _client_pid = os.getpid()
    return _client


def count(tag: str) -> None:
    """The whole body of every contender: wait BODY_SECONDS (if any), then count one
    execution under `tag`."""
    if BODY_SECONDS > 0:
        time.sleep(BODY_SECONDS)
    counters().incr(EXEC_PREFIX + tag)


def _plain(tag: str, job: int) -> None:
    count(tag)


def _jobfence(tag: str, job: int) -> None:
    count(tag)


def _plain_trips(tag: str, job: int) -> None:
    """The control: the round trips a jobfence job makes in its pool process (begin, commit),
    as two PINGs, with no lock, script or record: what the round trips alone cost a fleet."""
    client = counters()
    client.ping()
    client.ping()
    count(tag)


def _once(tag: str, job: int) -> None:
    count(tag)


def _singleton(tag: str, job: int) -> None:
    count(tag)


# Same trivial body, results ignored and acks_late for all four; only the gate differs.
plain = app.task(name="cbench.plain", ignore_result=True, acks_late=True)(_plain)
jobfence = singleton_task(app=app, name="cbench.jobfence", ignore_result=True)(_jobfence)
plain_trips = app.task(name="cbench.plain_trips", ignore_result=True, acks_late=True)(_plain_trips)
once = app.task(
    name="cbench.once",
    base=QueueOnce,
    once={"graceful": True},
    ignore_result=True,
    acks_late=True,
)(_once)
singleton = app.task(name="cbench.singleton", base=Singleton, ignore_result=True, acks_late=True)(
    _singleton
)


def _handled(args: Any = None, **_: Any) -> None:
    """Count every finished delivery of a storm job, whether its body ran or not."""
    if args and isinstance(args[0], str) and args[0].startswith(STORM_TAG):
        counters().incr(HANDLED_PREFIX + args[0])


def _ready(**_: Any) -> None:
    counters().incr(READY_KEY)


signals.task_postrun.connect(_handled, weak=False)
signals.worker_ready.connect(_ready, weak=False)
