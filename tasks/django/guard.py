"""The fence guard on Django's connection: check-and-advance a token inside transaction.atomic()."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)

from jobfence.config.errors import JobfenceError
from jobfence.locks.errors import LockError, StaleFence
from jobfence.locks.guards import check_args, commit_unknown
from jobfence.locks.sql import Settle, link_lost

FENCES_TABLE = "jobfence_fences"


class NotMigrated(JobfenceError):
    """jobfence's tables are missing from a Django database: ``migrate`` has not run for it."""


#: How each database says a table is missing (PostgreSQL, SQLite, MySQL/MariaDB).
_MISSING = ("does not exist", "no such table", "doesn't exist")


@contextmanager
def migrated(alias: str, *tables: str) -> Iterator[None]:
    """Turn "relation jobfence_fences does not exist" into the fix: run the migration."""
    try:
        yield
    except DatabaseError as exc:
        text = str(exc)
        missing = next((t for t in tables if t in text), None)
        if missing is None or not any(m in text for m in _MISSING):
            raise
        database = "" if alias == DEFAULT_DB_ALIAS else f" --database {alias}"
        raise NotMigrated(
            f"the table {missing} is missing from the Django database {alias!r}: run "
            f"`python manage.py migrate jobfence{database}` (with \"jobfence.tasks.django\" "
            "in INSTALLED_APPS)"
        ) from exc


@contextmanager
def atomic_watching_connection(alias: str, settle: Settle) -> Iterator[bool]:
    """``transaction.atomic(using=alias)`` in which a lost connection never reads as the body
    failing: lost anywhere in the block (opening it, a statement, an outermost block's
    COMMIT), ``settle(exc, at_commit)`` is told (see ``locks.sql.Settle``). Any other error
    propagates as it is. Yields whether the block is nested in an outer one."""
    conn = connections[alias]
    outer = conn.in_atomic_block
    entered = committing = False
    gone: Exception | None = None
    try:
        with transaction.atomic(using=alias):
            entered = True
            try:
                yield outer
            except Exception as exc:  # judged before the rollback drops the driver's link
                if link_lost(exc, conn.connection):
                    gone = exc
                raise
            committing = not outer
    except Exception as exc:
        if gone is not None:
            settle(gone, False)
        lost = link_lost(exc, conn.connection)
        if not (lost or isinstance(exc, (OperationalError, InterfaceError))):
            raise
        if committing:
            settle(exc, True)
            return
        if lost or not entered:
            settle(exc, False)
        raise


class DjangoFenceGuard:
    """Keeps the highest accepted token per resource in ``jobfence_fences``, as SqlFenceGuard.

        with transaction.atomic():
            fence_guard.check_and_advance(f"account:{account_id}", self.job.fence)
            Account.objects.filter(pk=account_id).update(...)

    An equal token passes (one holder writing twice), a lower one raises StaleFence and
    the atomic block rolls back. PostgreSQL and SQLite use one conditional upsert;
    MySQL/MariaDB an upsert keeping the greater token, then a locking read; other
    vendors an UPDATE, then an INSERT under a savepoint.
    """

    table = FENCES_TABLE

    def check_and_advance(self, resource: str, fence: int, *, using: str | None = None) -> None:
        check_args(resource, fence)
        conn = connections[using or DEFAULT_DB_ALIAS]
        if not conn.in_atomic_block:
            raise LockError(
                "the fence check must run inside the transaction that writes the resource; "
                "wrap it in `with transaction.atomic():` (or use guard.transaction(...))",
                key=resource,
            )
        with migrated(conn.alias, self.table):
            self._check_and_advance(conn, resource, fence)

    def _check_and_advance(self, conn: Any, resource: str, fence: int) -> None:
        qn = conn.ops.quote_name
        table, res, col = qn(self.table), qn("resource"), qn("fence")
        with conn.cursor() as cur:
            if conn.vendor in ("postgresql", "sqlite"):
                cur.execute(
                    f"INSERT INTO {table} ({res}, {col}) VALUES (%s, %s) "
                    f"ON CONFLICT ({res}) DO UPDATE SET {col} = excluded.{col} "
                    f"WHERE {table}.{col} <= excluded.{col}",
                    [resource, fence],
                )
                if cur.rowcount == 1:
                    return
                raise StaleFence(resource=resource, fence=fence, last=self._last(cur, resource))
            if conn.vendor == "mysql":  # MariaDB too
                # One upsert: an UPDATE that misses takes a gap lock, and two such transactions
                # inserting into one gap deadlock under REPEATABLE READ.
                cur.execute(
                    f"INSERT INTO {table} ({res}, {col}) VALUES (%s, %s) "
                    f"ON DUPLICATE KEY UPDATE {col} = GREATEST({col}, %s)",
                    [resource, fence, fence],
                )
                cur.execute(
                    f"SELECT {col} FROM {table} WHERE {res} = %s FOR UPDATE", [resource]
                )
                last = int(cur.fetchone()[0])
                if last > fence:
                    raise StaleFence(resource=resource, fence=fence, last=last)
                return
        self._update_or_insert(conn, resource, fence)

    def last(self, resource: str, *, using: str | None = None) -> int | None:
        """The highest token accepted so far for ``resource``."""
        with connections[using or DEFAULT_DB_ALIAS].cursor() as cur:
            return self._last(cur, resource)

    @contextmanager
    def transaction(self, resource: str, fence: int, *, using: str | None = None) -> Iterator[str]:
        """``with guard.transaction(resource, fence) as alias:`` an atomic block, token checked
        first. Yields the database alias, for ``Model.objects.using(alias)``. The connection
        lost anywhere in it raises ``CommitOutcomeUnknown`` (a job delivers again)."""
        alias = using or DEFAULT_DB_ALIAS

        def settle(lost: Exception, at_commit: bool) -> None:
            # No record here says whether the writes landed: the job comes back to find out.
            raise commit_unknown(resource, fence, lost, at_commit=at_commit) from lost

        with atomic_watching_connection(alias, settle):
            self.check_and_advance(resource, fence, using=alias)
            yield alias

    def _update_or_insert(self, conn: Any, resource: str, fence: int) -> None:
        qn = conn.ops.quote_name
        table, res, col = qn(self.table), qn("resource"), qn("fence")
        for _ in range(3):
            with conn.cursor() as cur:
                cur.execute(
                    f"UPDATE {table} SET {col} = %s WHERE {res} = %s AND {col} <= %s",
                    [fence, resource, fence],
                )
                if cur.rowcount:
                    return
                last = self._last(cur, resource)
                if last is not None:
                    raise StaleFence(resource=resource, fence=fence, last=last)
            try:
                with transaction.atomic(using=conn.alias), conn.cursor() as cur:
                    cur.execute(
                        f"INSERT INTO {table} ({res}, {col}) VALUES (%s, %s)", [resource, fence]
                    )
                return
            except IntegrityError:
                continue  # another transaction inserted it first: compare against theirs
        with conn.cursor() as cur:
            raise StaleFence(resource=resource, fence=fence, last=self._last(cur, resource))

    def _last(self, cur: Any, resource: str) -> int | None:
        qn = cur.db.ops.quote_name
        cur.execute(
            f"SELECT {qn('fence')} FROM {qn(self.table)} WHERE {qn('resource')} = %s", [resource]
        )
        row = cur.fetchone()
        return None if row is None else int(row[0])


#: The guard on the default database; pass ``using=`` for another.
fence_guard = DjangoFenceGuard()
