"""The demo's execution journal: executor events from every worker process, counted in Redis."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from jobfence.tasks.events import Event, Row
from jobfence.tasks.middleware import Delivery, Middleware
from jobfence.tasks.runtime import Runtime

JOURNAL_ENV = "JOBFENCE_DEMO_JOURNAL_URL"
PREFIX = "jobfence-demo:events:"


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=2.0,
                                retry=Retry(NoBackoff(), 0))


class RedisJournal(Middleware):
    """Executor middleware: HINCRBY <prefix><decision> <job key> 1, one command per decision."""

    routine = True  # it counts the runs that started too

    def __init__(self, url: str) -> None:
        self.client = _client(url)

    def on_event(self, delivery: Delivery, event: Event, row: Row) -> None:
        if row.decision is not None:
            self.client.hincrby(PREFIX + row.decision, delivery.spec.key, 1)


def connect(runtime: Runtime, environ: Mapping[str, str] | None = None) -> bool:
    """Attach a journal to the runtime's executor if JOBFENCE_DEMO_JOURNAL_URL is set."""
    url = (os.environ if environ is None else environ).get(JOURNAL_ENV)
    if not url:
        return False
    runtime.executor.use(RedisJournal(url))
    return True


def read(url: str) -> dict[str, Counter[str]]:
    """Per event, how many times it happened for each job key."""
    client = _client(url)
    try:
        out: dict[str, Counter[str]] = {}
        for name in client.scan_iter(match=PREFIX + "*"):
            fields = client.hgetall(name)
            out[str(name)[len(PREFIX) :]] = Counter({str(k): int(v) for k, v in fields.items()})
        return out
    finally:
        client.close()
