"""Custody of a worker's Redis-broker deliveries: a killed worker's jobs come back about one
lease TTL (their task's own) after its last record, not after kombu's visibility timeout.

On the Redis broker an unacked message lives in kombu's `unacked` hash and `unacked_index`
(tag -> delivery time) until its consumer acks it; kombu puts it back only once it is older
than the visibility timeout (3,600 s by default), whoever holds it. So each worker's main
process records here, every third of its shortest lease TTL and on the server's clock, the
delivery tags it holds (running, prefetched or waiting for an ETA: kombu's QoS `_delivered`),
each until its task's own lease TTL from now. Every worker then sweeps: a tag delivered more
than its task's TTL ago that no live custody holds belongs to a worker that is gone (its pool
children die with it: Celery sets PR_SET_PDEATHSIG), and goes back at the head of its queue,
marked redelivered, as a new delivery: under a fresh tag, its old entry removed in the same
transaction, so the ack of a holder that was only paused removes nothing of the new copy.

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
    """How often a worker records its custody, how long a record lasts at least, and how old
    an unacked delivery must be before a sweep may judge it (seconds). A delivery's own
    custody lasts its task's lease TTL (Custody.lease_ttl)."""

    every: float  # record, then sweep
    lifetime: float  # a record not renewed this long means its worker is gone
    grace: float  # a tag younger than this may not be in its worker's record yet

    @classmethod
    def for_ttl(cls, ttl: float) -> CustodyTimes:
        """The times for a worker whose shortest lease TTL is `ttl`."""
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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Custody:
    """One worker's custody record, and the sweep, on one kombu Redis channel.

    `lease_ttl(task name)` is the lease TTL of a gated task (a @singleton_task), None for any
    other: only a gated task's message is put back, once its own TTL has passed.
    """

    def __init__(
        self,
        channel: Any,
        *,
        worker_id: str,
        key: str,
        times: CustodyTimes,
        lease_ttl: Callable[[str], float | None],
    ) -> None:
        import redis

        self.channel = channel
        self.qos = channel.qos
        self.worker_id = worker_id
        self.times = times
        self.lease_ttl = lease_ttl
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

    def held(self) -> dict[str, float] | None:
        """The tags this worker holds now, each with how long its custody lasts (its task's
        lease TTL); None if the consumer kept changing them."""
        for _ in range(10):
            try:  # the consumer's thread appends and acks meanwhile: read again if it did
                acked = set(self.qos._dirty)  # acked, dropped from _delivered at the next append
                delivered = list(self.qos._delivered.items())
            except RuntimeError:
                continue
            return {
                _text(tag): self._lifetime(message)
                for tag, message in delivered
                if tag not in acked
            }
        return None

    def _lifetime(self, message: Any) -> float:
        name = (getattr(message, "headers", None) or {}).get("task")
        ttl = self.lease_ttl(name) if isinstance(name, str) else None
        return self.times.lifetime if ttl is None else ttl

    def keep(self) -> bool:
        """Record the tags held now, each for its task's TTL; False if they could not be read."""
        tags = self.held()
        if tags is None:
            return False
        lifetime_ms = max(1, int(self.times.lifetime * 1000))
        held = " ".join(f"{tag}={max(1, int(ttl * 1000))}" for tag, ttl in tags.items())
        self._keep(keys=[self.custody_key], args=[self.worker_id, lifetime_ms, held])
        return True

    def sweep(self) -> list[str]:
        """Put back the gated messages no live worker holds; returns their task names."""
        now = time.time()
        args = [now - self.times.grace, self._offset, SWEEP_LIMIT]
        looked, found = self._orphans(keys=[self.custody_key, self.index_key], args=args)
        mine = self.held() or {}
        pairs = [_text(x) for x in found or []]
        orphans = [
            (tag, float(at))
            for tag, at in zip(pairs[::2], pairs[1::2], strict=True)
            if tag not in mine  # ours, whatever the record says
        ]
        restored = self._restore(orphans, now) if orphans else []
        # A full page and nothing put back (long ETAs of live workers, plain tasks waiting
        # for the visibility timeout): the next sweep looks at the next page.
        full = looked >= SWEEP_LIMIT and not restored
        self._offset = self._offset + SWEEP_LIMIT if full else 0
        return restored

    def _restore(self, orphans: list[tuple[str, float]], now: float) -> list[str]:
        """Put back the gated messages among `orphans` (tag, delivery time) delivered more
        than their task's TTL before `now`; returns their task names."""
        restored: list[str] = []
        tags = [tag for tag, _ in orphans]
        for (tag, at), payload in zip(orphans, self.client.hmget(self.unacked_key, tags),
                                      strict=True):  # fmt: skip
            name = task_name(payload) if payload is not None else None  # None: acked meanwhile
            ttl = self.lease_ttl(name) if name is not None else None
            if ttl is None or at > now - ttl:
                continue  # not gated, or its own custody may not have lapsed yet
            if self.put_back(tag):
                restored.append(name)  # type: ignore[arg-type]
        if restored:
            log.warning(
                "custody: put back %d message(s) held by a worker that is gone: %s",
                len(restored),
                ", ".join(sorted(set(restored))),
            )
        return restored

    def put_back(self, tag: str) -> bool:
        """Put the message of `tag` back at the head of its queue as a new delivery; False if
        it was acked (or put back) meanwhile.

        The copy carries a fresh delivery tag and `tag`'s unacked entry goes in the same
        transaction (WATCHed, as kombu's `restore_by_tag`): the late ack of the holder it
        was taken from removes `tag`, never the new holder's entry (design section 10).
        """
        qos, channel = self.qos, self.channel
        put: list[bool] = []

        def transaction(pipe: Any) -> None:
            raw = pipe.hget(qos.unacked_key, tag)
            pipe.multi()
            qos._remove_from_indices(tag, pipe)
            put.clear()  # a retried transaction (WatchError) decides afresh
            if raw:
                message, exchange, routing_key = json.loads(_text(raw))
                message["properties"]["delivery_tag"] = channel._next_delivery_tag()
                channel._do_restore_message(message, exchange, routing_key, pipe)
                put.append(True)

        with channel.conn_or_acquire() as client:
            client.transaction(transaction, qos.unacked_key)
        return bool(put)

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

    default_ttl = runtime.settings.default_ttl
    ttls = {
        name: task.lease_ttl(default_ttl)
        for name, task in app.tasks.items()
        if isinstance(task, SingletonTask)
    }
    return Custody(
        channel,
        worker_id=f"{c.hostname}:{os.getpid()}",
        key=f"{runtime.settings.key_prefix}:custody:{channel.unacked_key}",
        # Recorded often enough for the shortest lease TTL here: no tag outlives its custody.
        times=CustodyTimes.for_ttl(min([default_ttl, *ttls.values()])),
        lease_ttl=ttls.get,
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
