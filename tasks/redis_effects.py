"""Layer 3 on Redis: a job's fenced write and its DONE record in one script, on its own store."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from redis import Redis

from jobfence.locks.errors import LockError
from jobfence.locks.guards import JobRecordArgs, RedisFenceGuard
from jobfence.tasks.context import JobContext
from jobfence.tasks.errors import IdempotencyConflict
from jobfence.tasks.keys import canonical_json

#: How long a DONE record is kept beside its effect by default: a week, as the lock server's.
DEFAULT_RECORD_TTL = 7 * 24 * 3600.0

Command = Sequence[str | int | float]


@dataclass
class RedisEffectTx:
    """The write being prepared. If `done`, the job already took effect: return `result`."""

    done: bool
    result: Any = None
    commands: list[Command] = field(default_factory=list)
    #: the replies of the commands once applied (empty when the record answered)
    replies: list[Any] = field(default_factory=list)

    def write(self, *commands: Command) -> None:
        """Queue commands (e.g. ("HINCRBY", "stock:{42}", "level", -1)); they run, fenced,
        with the job's DONE record, in one script when the block exits."""
        if self.done:
            raise LockError("the job already took effect (tx.done): return tx.result instead")
        self.commands.extend(commands)


class RedisEffects:
    """Fenced, exactly-once effects in one Redis (the effect's own, not the lock server).

        with effects.transaction(job, "stock:{42}") as tx:
            if tx.done:
                return tx.result
            tx.write(("HINCRBY", "stock:{42}", "level", -1))
            tx.result = {"reserved": 1}           # stored with the DONE record
        return tx.result

    At the block's exit one script checks and advances the resource's fence, runs the
    commands and stores the job's DONE record beside the resource, all or nothing. A later
    run of the same job (a duplicate granted again, with a higher fence, after the lock
    server lost its data; a resend after a lost reply) finds that record and applies
    nothing: `tx.done` is set and `tx.result` is the stored result. A fence guard alone
    cannot do this: it refuses older fences, never a re-run under a newer one. A stale
    fence raises StaleFence (nothing written). On a Redis Cluster the keys written must
    share the resource's hash slot: name them with the resource in braces.
    """

    def __init__(
        self,
        client: Redis,
        *,
        prefix: str = "jobfence",
        record_ttl: float = DEFAULT_RECORD_TTL,
        resends: int = 2,
    ) -> None:
        if isinstance(record_ttl, bool) or not isinstance(record_ttl, int | float) or not (
            0 < record_ttl < float("inf")
        ):
            raise LockError(
                f"record_ttl must be a positive number of seconds, got {record_ttl!r}: how "
                "long a finished job's DONE record answers its re-runs (default a week)"
            )
        self.guard = RedisFenceGuard(client, prefix=prefix, resends=resends)
        self.record_ttl = float(record_ttl)

    @contextmanager
    def transaction(self, job: JobContext, resource: str) -> Iterator[RedisEffectTx]:
        tx = self._lookup(job, resource)
        yield tx
        if tx.done:
            return
        record = JobRecordArgs(
            job.record_key,
            job.fingerprint,
            canonical_json(tx.result, what="the job result"),
            int(self.record_ttl * 1000),
        )
        out = self.guard.write_recorded(resource, job.fence, tx.commands, record)
        if out.applied:
            tx.replies = out.replies
        else:  # another run of the job took effect meanwhile: its result answers
            tx.done, tx.result = True, json.loads(out.result)

    def record(self, job_key: str, resource: str) -> dict[str, Any] | None:
        """The job's DONE record beside `resource`: fingerprint, result, fence; or None."""
        name = self.guard.keys.effect_record(resource, job_key)
        raw = self.guard.client.hgetall(name)
        if not raw:
            return None
        got = {_text(k): _text(v) for k, v in raw.items()}
        return {"fingerprint": got["fingerprint"], "result": json.loads(got["result"]),
                "fence": int(got["fence"])}  # fmt: skip

    def _lookup(self, job: JobContext, resource: str) -> RedisEffectTx:
        stored = self.record(job.record_key, resource)
        for key, fingerprint in job.previous if stored is None else ():
            # During a key rotation: the job's DONE record written under a previous secret.
            old = self.record(job.record_key_of(key), resource)
            if old is not None and old["fingerprint"] == fingerprint:
                return RedisEffectTx(done=True, result=old["result"])
        if stored is None:
            return RedisEffectTx(done=False)
        if stored["fingerprint"] != job.fingerprint:
            raise IdempotencyConflict(
                "job key already used with different arguments", key=job.key, fence=job.fence
            )
        return RedisEffectTx(done=True, result=stored["result"])


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
