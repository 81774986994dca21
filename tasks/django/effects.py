"""Layer 3 on Django's connection: a job's effect and its DONE row commit in one atomic block."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connections
from django.db import transaction as db_transaction

from jobfence.locks.errors import CommitOutcomeUnknown
from jobfence.tasks.context import JobContext
from jobfence.tasks.django.guard import DjangoFenceGuard, atomic_watching_connection, migrated
from jobfence.tasks.errors import IdempotencyConflict
from jobfence.tasks.keys import canonical_json

JOBS_TABLE = "jobfence_jobs"
_COLUMNS = ("job_key", "state", "fingerprint", "result", "fence", "finished_at")


@dataclass
class DjangoEffectTx:
    """The open atomic block. If ``done``, the job already took effect: return ``result``."""

    using: str
    done: bool
    result: Any = None

    @property
    def conn(self) -> Any:
        """Django's connection of this block (``tx.conn.cursor()`` for raw SQL)."""
        return connections[self.using]


class DjangoEffects:
    """Fenced, exactly-once effects through the Django ORM, the same contract as SqlEffects.

        with django_effects.transaction(self.job, f"payment:{payment_id}") as tx:
            if tx.done:
                return tx.result
            Payment.objects.create(...)      # the effect, on the same connection
            tx.result = {...}                # stored with the DONE row
        return tx.result

    Each resource's fence is checked and advanced first (StaleFence rolls everything
    back); the DONE row is inserted in the same ``transaction.atomic()`` block, so a later
    execution of the job finds it, and two racing executions collide on its primary key.
    Nested in an outer atomic block (a caller's, ``ATOMIC_REQUESTS``, a ``TestCase``) it
    becomes a savepoint that commits with the outer one, and the lock server's record waits
    for that commit (``on_commit``; none on rollback, and the job may run again). A
    connection lost inside the block committed nothing: ``CommitOutcomeUnknown``, and the
    job is delivered again, never failed. Lost at COMMIT, the DONE row is read on a fresh
    connection: there, the block landed; else ``CommitOutcomeUnknown``. A user's own error
    on a live connection (an IntegrityError) fails the job as before.
    """

    def __init__(self, *, using: str = DEFAULT_DB_ALIAS, guard: DjangoFenceGuard | None = None):
        self.using = using
        self.guard = guard or DjangoFenceGuard()

    @contextmanager
    def transaction(
        self, job: JobContext, *resources: str, using: str | None = None
    ) -> Iterator[DjangoEffectTx]:
        alias = using or self.using
        tx: DjangoEffectTx | None = None

        def settle(lost: Exception, at_commit: bool) -> None:
            self._settle(alias, job, tx, lost, at_commit)

        with atomic_watching_connection(alias, settle) as outer:
            for resource, fence in job.guarded_rows(resources):  # one order: no deadlocks
                self.guard.check_and_advance(resource, fence, using=alias)
            with migrated(alias, JOBS_TABLE):
                tx = self._lookup(alias, job)
            job.effect_opened(tx.done)
            yield tx
            if not tx.done:
                result = canonical_json(tx.result, what="the job result")
                self._insert_done(alias, job, result)
        if outer:  # a replay too: the DONE row it read may be the block's own, uncommitted
            db_transaction.on_commit(job.join_outer().commit, using=alias)

    def record(self, job_key: str, *, using: str | None = None) -> dict[str, Any] | None:
        """The stored row of ``job_key`` (``result`` still as JSON text), or None."""
        conn = connections[using or self.using]
        qn = conn.ops.quote_name
        with conn.cursor() as cur:
            cur.execute(
                f"SELECT {', '.join(qn(c) for c in _COLUMNS)} FROM {qn(JOBS_TABLE)} "
                f"WHERE {qn('job_key')} = %s",
                [job_key],
            )
            row = cur.fetchone()
        return None if row is None else dict(zip(_COLUMNS, row, strict=True))

    def _settle(
        self,
        alias: str,
        job: JobContext,
        tx: DjangoEffectTx | None,
        lost: Exception,
        at_commit: bool,
    ) -> None:
        """The connection was lost. Before COMMIT nothing committed: deliver again. At COMMIT
        its reply never came: it landed if our DONE row is there (read on a fresh
        connection); else, or if that cannot be read, the outcome stays unknown."""
        if not at_commit:
            raise CommitOutcomeUnknown(
                "the connection was lost inside the effect's transaction, before its COMMIT: "
                "nothing committed", key=job.key, fence=job.fence, reason=type(lost).__name__,
            ) from lost  # fmt: skip
        if tx is None or tx.done:
            return  # a replay: the stored result is known
        connections[alias].close()  # the old link is dead; the next query opens a new one
        try:
            row = self.record(job.record_key, using=alias)
        except (OperationalError, InterfaceError) as again:
            raise CommitOutcomeUnknown(
                "the connection was lost at the effect's COMMIT and the database cannot be "
                "read", key=job.key, fence=job.fence,
                reason=f"{type(lost).__name__}, then {type(again).__name__}",
            ) from lost  # fmt: skip
        if row is not None and row["fence"] == job.fence and row["fingerprint"] == job.fingerprint:
            return  # it landed: the effect and its DONE row are in
        raise CommitOutcomeUnknown(
            "the connection was lost at the effect's COMMIT, which did not land",
            key=job.key, fence=job.fence, reason=type(lost).__name__,
        ) from lost  # fmt: skip

    def _lookup(self, alias: str, job: JobContext) -> DjangoEffectTx:
        conn = connections[alias]
        qn = conn.ops.quote_name
        query = (f"SELECT {qn('fingerprint')}, {qn('result')} FROM {qn(JOBS_TABLE)} "
                 f"WHERE {qn('job_key')} = %s")  # fmt: skip
        with conn.cursor() as cur:
            cur.execute(query, [job.record_key])
            row = cur.fetchone()
            for key, fingerprint in job.previous if row is None else ():
                # During a key rotation: the job's DONE row written under a previous secret.
                cur.execute(query, [job.record_key_of(key)])
                old = cur.fetchone()
                if old is not None and old[0] == fingerprint:
                    return DjangoEffectTx(alias, done=True, result=json.loads(old[1]))
        if row is None:
            return DjangoEffectTx(alias, done=False)
        if row[0] != job.fingerprint:
            raise IdempotencyConflict(
                "job key already used with different arguments", key=job.key, fence=job.fence
            )
        return DjangoEffectTx(alias, done=True, result=json.loads(row[1]))

    def _insert_done(self, alias: str, job: JobContext, result: str) -> None:
        conn = connections[alias]
        qn = conn.ops.quote_name
        with conn.cursor() as cur:
            cur.execute(
                f"INSERT INTO {qn(JOBS_TABLE)} ({', '.join(qn(c) for c in _COLUMNS)}) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                [job.record_key, "DONE", job.fingerprint, result, job.fence, time.time()],
            )


#: Effects on the default database; ``transaction(..., using="other")`` for another.
django_effects = DjangoEffects()
