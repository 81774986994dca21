"""THE fleet test of global_rate_limit: three workers of two processes each hold 5/s between
them, within 5 % over most of a minute (the suite's time allows no more), while Celery's
own rate_limit on the same fleet (the control, run at the same time) gives 5/s to each
worker.

The first seconds are a transient, reported but not held to 5 %: all jobs arrive at once,
each first delivery reserves a turn and re-publishes itself, and the copies for the nearest
turns queue behind that first pass; a copy later than RATE_LATE_SLACK gives its turn up
(never bunching) and takes a new one at the end of the line. The rate is measured from
WARM_UP seconds after the first start to the last."""

from __future__ import annotations

import time

import redis

from jobfence.tasks.executor import RATE_LATE_SLACK
from tests.integration.apps import rate_app
from tests.integration.apps.common import app_env
from tests.integration.celery_fleet import FleetFactory
from tests.servers import RedisServer

APP = "tests.integration.apps.rate_app"
WORKERS, PROCESSES = 3, 2
RATE = 5.0  # per second, "5/s" for both tasks
GLOBAL_JOBS = 240  # 48 s of turns at 5/s, plus the turns lost in the transient
WARM_UP = 5.0
CELERY_JOBS = 300  # at 5/s per worker: ~20 s


def _starts(ledger: redis.Redis, key: str) -> list[float]:
    return sorted(float(s) for s in ledger.lrange(key, 0, -1))


def _rate(starts: list[float]) -> float:
    return (len(starts) - 1) / (starts[-1] - starts[0])


def _busiest(starts: list[float], window: float) -> int:
    return max(sum(1 for s in starts[i:] if s < t0 + window) for i, t0 in enumerate(starts))


def test_global_rate_limit_holds_fleet_wide_while_celerys_is_per_worker(
    module_redis: RedisServer, fleet_factory: FleetFactory
) -> None:
    base = f"redis://{module_redis.host}:{module_redis.port}"
    env = app_env(
        f"{base}/0",
        ledger_url=f"{base}/1",
        # Reserved turns come back by countdown (capped at half of it): above the minute.
        visibility_timeout=150.0,
        LOCK_URL=f"{base}/2",
        RATE=f"{RATE:g}/s",
    )
    fleet = fleet_factory(
        APP, env=env, workers=WORKERS, concurrency=PROCESSES, extra_args=["-Q", "celery,control"]
    )
    client = rate_app.create_app(env)
    ledger = redis.Redis.from_url(env["LEDGER_URL"])
    try:
        glob, celery = client.tasks["rate.global"], client.tasks["rate.celery"]
        for i in range(max(GLOBAL_JOBS, CELERY_JOBS)):
            if i < GLOBAL_JOBS:
                glob.delay(i)
            if i < CELERY_JOBS:
                celery.delay(i)
        deadline = time.monotonic() + GLOBAL_JOBS / RATE + 30
        while ledger.llen(rate_app.STARTS["global"]) < GLOBAL_JOBS:
            assert time.monotonic() < deadline, fleet.logs()
            time.sleep(0.5)  # a poll with a deadline: the jobs take a minute by design
        g = _starts(ledger, rate_app.STARTS["global"])
        c = _starts(ledger, rate_app.STARTS["celery"])
    finally:
        ledger.close()
        client.close()
    steady = [s for s in g if s >= g[0] + WARM_UP]
    measured, overall, control = _rate(steady), _rate(g), _rate(c)
    print(
        f"\nglobal_rate_limit={RATE:g}/s: {len(g)} starts over {g[-1] - g[0]:.1f}s "
        f"({overall:.3f}/s overall); after {WARM_UP:g}s: {len(steady)} starts over "
        f"{steady[-1] - steady[0]:.1f}s, {measured:.3f}/s ({(measured - RATE) / RATE:+.2%}); "
        f"busiest 10 s: {_busiest(g, 10)}\n"
        f"celery rate_limit={RATE:g}/s: {len(c)} starts over {c[-1] - c[0]:.1f}s, "
        f"{control:.3f}/s = {control / RATE:.2f} x the limit ({WORKERS} workers x {PROCESSES})"
    )
    assert len(g) == GLOBAL_JOBS  # each job ran once: none lost, none twice
    assert steady[-1] - steady[0] >= 40.0  # a minute-scale window
    assert abs(measured - RATE) / RATE <= 0.05
    # The GCRA bound (10 s x rate + burst), plus the copies a late start may bunch: a copy
    # later than RATE_LATE_SLACK after its turn takes a new one.
    assert _busiest(g, 10.0) <= 10.0 * RATE + 1 + RATE * RATE_LATE_SLACK
    # The control: Celery's rate_limit is kept by each worker apart, so the fleet runs
    # several times the limit.
    assert len(c) == CELERY_JOBS
    assert control > 2 * RATE
