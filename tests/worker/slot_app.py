"""A worker app for the beat tests: `create_app` plus one @singleton_task that logs each run.

Built from JOBFENCE_* on import (as `celery -A tests.worker.slot_app worker` does); each run
appends {"key", "pid"} to the Redis list `runs` at $SLOT_RECORD_URL.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis

from jobfence.tasks import current_job, singleton_task
from jobfence.worker.app import create_app

RECORD = "beat-test.record"

app = create_app(include=[], beat_schedule={})


@singleton_task(app=app, name=RECORD)
def record() -> dict[str, Any]:
    job = current_job()
    client = redis.Redis.from_url(os.environ["SLOT_RECORD_URL"])
    try:
        client.rpush("runs", json.dumps({"key": job.key, "pid": os.getpid()}))
    finally:
        client.close()
    return {"key": job.key}
