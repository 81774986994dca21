"""A lock server that stalls, with real workers: the job comes back and runs once, never FAILURE.

The broker, the ledger and the results live on the module's Redis; the locks on a private
redis-server of their own, which the test pauses (SIGSTOP) by pid.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from celery import Celery

from jobfence.locks import BackendUnavailable, RedisBackend
from jobfence.tasks import runtime_for
from tests.integration.apps import singleton_app
from tests.integration.apps.common import app_env
from tests.integration.celery_fleet import Fleet, FleetFactory
from tests.integration.ledger import Ledger
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.apps.singleton_app"
SOCKET_TIMEOUT = 0.3
STALL = 0.6


@dataclass
class StallFleet:
    fleet: Fleet
    app: Celery
    ledger: Ledger
    broker: redis.Redis
    locks: RedisServer


@pytest.fixture(scope="module")
def stall_fleet(
    module_redis: RedisServer, fleet_factory: FleetFactory
) -> Iterator[StallFleet]:
    with RedisServer() as locks:
        server = f"redis://{module_redis.host}:{module_redis.port}"
        env = app_env(
            module_redis.url,  # broker: db 0
            ledger_url=f"{server}/1",
            LOCK_URL=locks.url,
            RESULT_BACKEND=f"{server}/3",
            LEASE_TTL="2.0",
            LOCK_SOCKET_TIMEOUT=repr(SOCKET_TIMEOUT),
            JOBFENCE_REDELIVERY_DELAY="0.2",
        )
        fleet = fleet_factory(APP, env=env, workers=1, concurrency=1)
        app = singleton_app.create_app(env, name="stall-client")
        ledger = Ledger.from_url(f"{server}/1")
        try:
            yield StallFleet(fleet, app, ledger, module_redis.client(), locks)
        finally:
            if locks.paused:
                locks.resume()
            fleet.stop()
            ledger.close()
            runtime_for(app).close()
            app.close()


@pytest.mark.parametrize("explicit_key", [False, True], ids=["argument-key", "explicit-key"])
def test_a_lock_server_stall_during_begin_redelivers_and_the_job_runs_once(
    stall_fleet: StallFleet, explicit_key: bool
) -> None:
    s = stall_fleet
    job = f"job-{uuid.uuid4().hex[:12]}"
    # A caller's own idempotency key must survive the re-publish, or the redelivered copy
    # would run under another key than the one the caller asked for.
    explicit = f"order-{job}" if explicit_key else None
    options = {"idempotency_key": explicit} if explicit else {}
    control = RedisBackend.from_url(s.locks.url, socket_timeout=SOCKET_TIMEOUT)
    s.locks.pause()
    paused_at = time.monotonic()
    try:
        # Control: during the stall a begin fails; before the policy the task let it through
        # as FAILURE BackendUnavailable, and the message was acked with the body never run.
        with pytest.raises(BackendUnavailable):
            control.begin(f"control-{job}", 2.0)
        result = s.app.tasks["singleton.record"].apply_async(args=[job], **options)
        # The stall lasts 0.6 s at least, and until a delivery has met it (a loaded box may
        # take longer to hand the message to the worker).
        wait_for(
            lambda: any(o["state"] == "IGNORED" for o in s.ledger.outcomes(job, result.id)),
            20.0,
            interval=0.02,
            message=lambda: s.ledger.summary(job) + "\n" + s.fleet.logs(lines=20),
        )
        time.sleep(max(0.0, STALL - (time.monotonic() - paused_at)))
    finally:
        s.locks.resume()
    assert result.get(timeout=20.0) == 1
    s.fleet.wait_idle(s.broker, timeout=20.0)
    states = [o["state"] for o in s.ledger.outcomes(job, result.id)]
    assert "FAILURE" not in states and states[-1] == "SUCCESS", states
    assert s.ledger.start_count(job) == 1 and s.ledger.effect_count(job) == 1
    log = s.fleet.logs(lines=200)
    assert "redelivering singleton.record" in log and "lock server unavailable" in log
    key = s.app.tasks["singleton.record"].identity([job], {}, explicit)[0]
    record = runtime_for(s.app).backend.job_record(key)
    assert record is not None and record.state == "DONE"
    control.close()
