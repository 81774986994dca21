"""A task under a global rate limit and its control under Celery's own rate_limit, on one fleet.

Built from the variables of :mod:`tests.integration.apps.common`, plus ``LOCK_URL`` (the
jobfence lock server) and ``RATE`` (both tasks' limit, default ``5/s``); workers consume
the queues ``celery`` and ``control``. Each body appends its start time, read from the
ledger Redis server's clock (TIME), and its argument to ``starts:<task>``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import redis
from celery import Celery

from jobfence.config import Settings
from jobfence.tasks import install, singleton_task
from tests.integration.apps.common import app_on_first_access, make_app, transport_options

__all__ = ["STARTS", "create_app"]

#: The ledger list each task appends its start times to.
STARTS = {"global": "starts:rate.global", "celery": "starts:rate.celery"}
_STAMP = (
    "local t = redis.call('TIME') "
    "local now = t[1] .. '.' .. string.format('%06d', t[2]) "
    "return redis.call('RPUSH', KEYS[1], now .. ' ' .. ARGV[1])"
)
_clients: dict[int, redis.Redis] = {}


def _record(url: str, key: str, job: int) -> None:
    client = _clients.get(os.getpid())
    if client is None:  # one per pool process: a forked child must not share its parent's
        client = _clients[os.getpid()] = redis.Redis.from_url(url)
    client.eval(_STAMP, 1, key, job)


def create_app(env: Mapping[str, str]) -> Celery:
    app = make_app("rate", env)
    install(
        app,
        Settings(
            lock_url=env.get("LOCK_URL") or env["BROKER_URL"],
            visibility_timeout=float(transport_options(env)["visibility_timeout"]),
        ),
    )
    ledger_url, rate = env.get("LEDGER_URL") or env["BROKER_URL"], env.get("RATE", "5/s")

    @singleton_task(app=app, name="rate.global", global_rate_limit=rate, shared=False)
    def global_limited(i: int) -> int:
        _record(ledger_url, STARTS["global"], i)
        return i

    # On a queue of its own: a worker holding its rate-limited tasks (prefetch 1) stops
    # fetching from that queue, and the other task's copies must not wait behind them.
    @app.task(name="rate.celery", rate_limit=rate, queue="control", shared=False)  # type: ignore[untyped-decorator]
    def celery_limited(i: int) -> int:
        _record(ledger_url, STARTS["celery"], i)
        return i

    return app


__getattr__ = app_on_first_access(__name__, create_app)
