"""A Redis ledger where integration-test tasks record every start, effect and end of a job."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis

__all__ = ["Ledger"]


def _decode(items: list[Any]) -> list[dict[str, Any]]:
    return [json.loads(item) for item in items]


class Ledger:
    """Per-job execution records in Redis, written by workers and read by tests.

    Keys (``<prefix>:<job_id>:...``): ``starts`` and ``effects`` and ``ends`` are lists of
    JSON records, and so is ``outcomes`` (how each delivery ended, whether or not its body
    ran); ``running`` counts bodies currently inside the task, so the ``concurrent`` field
    of a start record is how many bodies of that job were running at that moment (an
    overlap when > 1); ``release`` opens the gate that gated tasks wait on.
    """

    def __init__(self, client: redis.Redis, prefix: str = "ledger") -> None:
        self.client = client
        self.prefix = prefix

    @classmethod
    def from_url(cls, url: str, prefix: str = "ledger") -> Ledger:
        client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
        return cls(client, prefix)

    def key(self, job_id: str, field: str) -> str:
        return f"{self.prefix}:{job_id}:{field}"

    @staticmethod
    def _stamp(extra: dict[str, Any]) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "t": time.time(), **extra}

    # -- worker side ----------------------------------------------------------------

    def start(self, job_id: str, **info: Any) -> int:
        """Record a body start; returns how many bodies of ``job_id`` are running now."""
        running = int(self.client.incr(self.key(job_id, "running")))
        record = self._stamp({**info, "concurrent": running})
        self.client.rpush(self.key(job_id, "starts"), json.dumps(record))
        return running

    def effect(self, job_id: str, **info: Any) -> int:
        """Record the job's side effect; returns how many effects ``job_id`` has had."""
        return int(self.client.rpush(self.key(job_id, "effects"), json.dumps(self._stamp(info))))

    def end(self, job_id: str, **info: Any) -> None:
        """Record a body end (not reached when the process is killed mid-task)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.decr(self.key(job_id, "running"))
        pipe.rpush(self.key(job_id, "ends"), json.dumps(self._stamp(info)))
        pipe.execute()

    def outcome(self, job_id: str, **info: Any) -> None:
        """Record how one delivery ended (state, value), whether or not the body ran."""
        self.client.rpush(self.key(job_id, "outcomes"), json.dumps(self._stamp(info)))

    def released(self, job_id: str) -> bool:
        return bool(self.client.exists(self.key(job_id, "release")))

    # -- test side ------------------------------------------------------------------

    def release(self, job_id: str) -> None:
        """Open the gate: every gated body of ``job_id``, current or future, goes on."""
        self.client.set(self.key(job_id, "release"), 1)

    def starts(self, job_id: str) -> list[dict[str, Any]]:
        return _decode(self.client.lrange(self.key(job_id, "starts"), 0, -1))

    def start_count(self, job_id: str) -> int:
        return int(self.client.llen(self.key(job_id, "starts")))

    def effects(self, job_id: str) -> list[dict[str, Any]]:
        return _decode(self.client.lrange(self.key(job_id, "effects"), 0, -1))

    def effect_count(self, job_id: str) -> int:
        return int(self.client.llen(self.key(job_id, "effects")))

    def ends(self, job_id: str) -> list[dict[str, Any]]:
        return _decode(self.client.lrange(self.key(job_id, "ends"), 0, -1))

    def end_count(self, job_id: str) -> int:
        return int(self.client.llen(self.key(job_id, "ends")))

    def outcomes(self, job_id: str, task_id: str | None = None) -> list[dict[str, Any]]:
        """Delivery outcomes of ``job_id`` in the order they ended (optionally one task id's)."""
        records = _decode(self.client.lrange(self.key(job_id, "outcomes"), 0, -1))
        return [r for r in records if task_id is None or r.get("task_id") == task_id]

    def max_concurrent(self, job_id: str) -> int:
        """The most bodies of ``job_id`` seen running at once (1 = never overlapped)."""
        return max((s.get("concurrent", 0) for s in self.starts(job_id)), default=0)

    def summary(self, job_id: str) -> str:
        """One line for assertion messages."""
        return (
            f"job {job_id}: starts={self.start_count(job_id)} "
            f"effects={self.effect_count(job_id)} ends={self.end_count(job_id)} "
            f"max_concurrent={self.max_concurrent(job_id)}"
        )

    def reset(self) -> None:
        """Delete every ledger key (not the rest of the database)."""
        keys = list(self.client.scan_iter(match=f"{self.prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            self.client.delete(*keys[i : i + 500])

    def close(self) -> None:
        self.client.close()
