"""A worker and beat app for the beat tests: `create_app` plus @singleton_tasks that log each run.

Built from JOBFENCE_* on import (as `celery -A tests.worker.slot_app worker|beat` does); each
run appends {"key", "pid", "task", "id"} to the Redis list `runs` at $SLOT_RECORD_URL. With
$SLOT_BEAT_EVERY (seconds) the beat schedule has one entry, "every", of `record` on that
interval; $SLOT_BEAT_CATCHUP sets `jobfence_beat_catchup`.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import redis

from jobfence.tasks import current_job, singleton_task
from jobfence.worker.app import create_app

RECORD = "beat-test.record"
RECORD_START = "beat-test.record-start"  # lock_until="start": each run's record is its own
RECORD_UNIQUE = "beat-test.record-unique"  # unique_for: the same, and a throttle after it
UNIQUE_FOR = 1.0
ENTRY = "every"

_every = os.environ.get("SLOT_BEAT_EVERY")
app = create_app(
    include=[],
    beat_schedule=(
        {ENTRY: {"task": RECORD, "schedule": timedelta(seconds=float(_every))}} if _every else {}
    ),
)
if os.environ.get("SLOT_BEAT_CATCHUP"):
    app.conf.jobfence_beat_catchup = float(os.environ["SLOT_BEAT_CATCHUP"])


def _record(task: str) -> dict[str, Any]:
    job = current_job()
    client = redis.Redis.from_url(os.environ["SLOT_RECORD_URL"])
    try:
        run = {"key": job.key, "pid": os.getpid(), "task": task, "id": job.task_id}
        client.rpush("runs", json.dumps(run))
    finally:
        client.close()
    return {"key": job.key}


@singleton_task(app=app, name=RECORD)
def record() -> dict[str, Any]:
    return _record(RECORD)


@singleton_task(app=app, name=RECORD_START, lock_until="start", on_conflict="wait")
def record_start() -> dict[str, Any]:
    return _record(RECORD_START)


@singleton_task(app=app, name=RECORD_UNIQUE, unique_for=UNIQUE_FOR)
def record_unique() -> dict[str, Any]:
    return _record(RECORD_UNIQUE)
