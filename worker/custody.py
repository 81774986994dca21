"""Custody of a worker's Redis-broker deliveries: a killed worker's jobs come back within about
two lease TTLs, not after kombu's visibility timeout.

On the Redis broker an unacked message lives in kombu's `unacked` hash and `unacked_index`
(tag -> delivery time) until its consumer acks it; kombu puts it back only once it is older
than the visibility timeout (3,600 s by default), whoever holds it. So each worker's main
process records here, every TTL/3 and for one TTL on the server's clock, the delivery tags
it holds (running, prefetched or waiting for an ETA: kombu's QoS `_delivered`). Every worker
then sweeps: a tag delivered more than one TTL ago that no live custody holds belongs to a
worker that is gone (its pool children die with it: Celery sets PR_SET_PDEATHSIG), and
kombu's own `QoS.restore_by_tag` puts it back at the head of its queue, marked redelivered.

Only messages of @singleton_task tasks are put back early: their gate absorbs a copy whose
job is still running (the same task id defers until the lease ends) or done (the record
answers). A plain Celery task's message keeps waiting for the visibility timeout, since an
early copy of it would simply run twice. RabbitMQ needs none of this: it returns a
consumer's unacked messages as soon as its connection closes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from celery import bootsteps

from jobfence.tasks import SingletonTask
from jobfence.tasks.runtime import installed

log = logging.getLogger(__name__)

CUSTODY_SETTING = "jobfence_custody"  # Celery setting: False turns custody and sweep off
SWEEP_LIMIT = 1000  # overdue tags looked at per sweep (one page; see Custody.sweep)


@cache
def script_source(name: str) -> str:
    lua = resources.files("jobfence.worker").joinpath("lua", f"{name}.lua")
    return lua.read_text(encoding="utf-8")


@dataclass(frozen=True)
class CustodyTimes:
    """How often a worker records its custody, how long a record lasts, and how old an
    unacked delivery must be before a sweep may judge it (seconds)."""

    every: float  # record, then sweep
    lifetime: float  # a record not renewed this long means its worker is gone
    grace: float  # a tag younger than this may not be in its worker's record yet

    @classmethod
    def for_ttl(cls, ttl: float) -> CustodyTimes:
        # Three records per lifetime: one late or lost record never lapses a live worker.
        return cls(every=ttl / 3, lifetime=ttl, grace=ttl)


def task_name(payload: bytes | str) -> str | None:
    """The task name in one entry of kombu's `unacked` hash ([message, exchange, key])."""
    try:
        message = json.loads(payload)[0]
        name = message["headers"]["task"]
    except (ValueError, LookupError, TypeError):
        return None  # not a Celery protocol-2 task message: never put back early
    return name if isinstance(name, str) else None


class Custody:
    """One worker's custody record, and the sweep, on one kombu Redis channel."""

    def __init__(
        self,
        channel: Any,
        *,
        worker_id: str,
        key: str,
        times: CustodyTimes,
        gated: Callable[[str], bool],
    ) -> None:
        import redis

        self.channel = channel
        self.qos = channel.qos
        self.worker_id = worker_id
        self.times = times
        self.gated = gated
        # A plain client on kombu's pool, keys named in full: kombu's prefixing client would
        # prefix only the first key of a script.
        self.client = redis.Redis(connection_pool=channel.pool)
        prefix = str(getattr(channel, "global_keyprefix", "") or "")
        self.custody_key = prefix + key
        self.unacked_key = prefix + str(channel.unacked_key)
        self.index_key = prefix + str(channel.unacked_index_key)
        self._keep = self.client.register_script(script_source("custody_keep"))
        self._orphans = self.client.register_script(script_source("custody_orphans"))
        self._offset = 0  # where the next sweep starts among the overdue tags

    def held(self) -> set[str] | None:
        """The tags this worker holds now; None if the consumer kept changing them."""
        for _ in range(10):
            try:  # the consumer's thread appends and acks meanwhile: read again if it did
                return {t if isinstance(t, str) else t.decode() for t in list(self.qos._delivered)}
            except RuntimeError:
                continue
        return None

    def keep(self) -> bool:
        """Record the tags held now, for one lifetime; False if they could not be read."""
        tags = self.held()
        if tags is None:
            return False
        lifetime_ms = max(1, int(self.times.lifetime * 1000))
        self._keep(keys=[self.custody_key], args=[self.worker_id, lifetime_ms, " ".join(tags)])
        return True

    def sweep(self) -> list[str]:
        """Put back the gated messages no live worker holds; returns their task names."""
        cutoff = time.time() - self.times.grace
        args = [cutoff, self._offset, SWEEP_LIMIT]
        looked, found = self._orphans(keys=[self.custody_key, self.index_key], args=args)
        mine = self.held() or set()
        tags = [t.decode() if isinstance(t, bytes) else str(t) for t in found or []]
        tags = [t for t in tags if t not in mine]  # ours, whatever the record says
        restored = self._restore(tags) if tags else []
        # A full page and nothing put back (long ETAs of live workers, plain tasks waiting
        # for the visibility timeout): the next sweep looks at the next page.
        full = looked >= SWEEP_LIMIT and not restored
        self._offset = self._offset + SWEEP_LIMIT if full else 0
        return restored

    def _restore(self, tags: list[str]) -> list[str]:
        """Put back the gated messages among `tags`; returns their task names."""
        restored: list[str] = []
        for tag, payload in zip(tags, self.client.hmget(self.unacked_key, tags), strict=True):
            name = task_name(payload) if payload is not None else None  # None: acked meanwhile
            if name is None or not self.gated(name):
                continue
            # kombu's own: WATCHes the unacked hash, so a concurrent ack or another
            # worker's sweep of the same tag puts nothing back twice.
            self.qos.restore_by_tag(tag, client=self.channel.client)
            restored.append(name)
        if restored:
            log.warning(
                "custody: put back %d message(s) held by a worker that is gone: %s",
                len(restored),
                ", ".join(sorted(set(restored))),
            )
        return restored

    def forget(self) -> None:
        """Drop this worker's record (a clean stop: kombu put its messages back itself)."""
        self.client.hdel(self.custody_key, self.worker_id)


class CustodyStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: a thread that records this worker's custody and sweeps.

    A thread, not the event loop's timer: a solo pool runs tasks on the loop, and a long
    task must not lapse its own worker's custody.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._custody: Custody | None = None

    def start(self, c: Any) -> None:
        custody = build(c)
        if custody is None:
            return
        self._custody = custody
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=run, args=(custody, self._stopping), name="jobfence-custody", daemon=True
        )
        self._thread.start()

    def stop(self, c: Any) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if self._custody is not None:
            try:
                self._custody.forget()
            except Exception as exc:  # the record lapses on its own
                log.debug("custody: record not dropped: %r", exc)
            self._custody = None

    shutdown = stop


def build(c: Any) -> Custody | None:
    """The custody of consumer `c`, or None: custody off, no jobfence runtime, not Redis."""
    app = c.app
    runtime = installed(app)
    if runtime is None or app.conf.get(CUSTODY_SETTING) is False:
        return None
    channel = getattr(c.task_consumer, "channel", None)
    try:
        from kombu.transport.redis import QoS
    except ImportError:  # redis-py absent: not a Redis broker
        return None
    if channel is None or not isinstance(getattr(channel, "qos", None), QoS):
        return None  # RabbitMQ returns a closed connection's unacked messages at once

    def gated(name: str) -> bool:
        return isinstance(app.tasks.get(name), SingletonTask)

    return Custody(
        channel,
        worker_id=f"{c.hostname}:{os.getpid()}",
        key=f"{runtime.settings.key_prefix}:custody:{channel.unacked_key}",
        times=CustodyTimes.for_ttl(runtime.settings.default_ttl),
        gated=gated,
    )


def run(custody: Custody, stopping: threading.Event) -> None:
    """Record, then sweep, every `custody.times.every` seconds until `stopping` is set."""
    failing = False
    while not stopping.is_set():
        try:
            custody.keep()
            custody.sweep()
            if failing:
                log.info("custody: the broker answers again")
            failing = False
        except Exception as exc:  # a broker blip: the next round tries again
            if not failing:
                log.warning("custody: record or sweep failed: %s", type(exc).__name__)
            failing = True
        stopping.wait(custody.times.every)


def connect(app: Any) -> None:
    """Add the custody step to `app`'s worker consumer (a no-op off the Redis broker)."""
    app.steps["consumer"].add(CustodyStep)
