"""Hold finished tasks before their ack, while a flag is up: the "ack lost" window on demand.

Both fault apps connect :func:`connect`. After a body returned (``task_postrun`` runs in the
pool process, before the result reaches the main process that acks), the process waits while
``HOLD_KEY`` exists on ``HOLD_URL``, up to ``HOLD_LIMIT`` seconds. A test raises the flag,
lets bodies commit their effects, then kills the worker: the effect is done, the ack never
sent, and the broker delivers the message again.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import signals

HOLD_ENV = "HOLD_URL"
HOLD_KEY = "fault:hold-acks"
HOLD_LIMIT = 120.0


def _hold(**_: Any) -> None:
    url = os.environ.get(HOLD_ENV)
    if not url:
        return
    client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    deadline = time.monotonic() + HOLD_LIMIT
    try:
        while time.monotonic() < deadline:
            try:
                if not client.exists(HOLD_KEY):
                    return
            except redis.RedisError:
                return  # no flag server (a row that stops it): nothing is held
            time.sleep(0.05)
    finally:
        client.close()


def connect() -> None:
    signals.task_postrun.connect(_hold, weak=False, dispatch_uid="tests.faults.hold")


def raise_flag(client: redis.Redis) -> None:
    client.set(HOLD_KEY, 1)


def lower_flag(client: redis.Redis) -> None:
    client.delete(HOLD_KEY)
