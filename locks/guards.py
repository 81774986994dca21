"""Fence guards: check-and-advance a resource's fencing token inside the caller's transaction."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from redis import Redis
from sqlalchemy import BigInteger, Column, Connection, Engine, MetaData, String, Table, func, select
from sqlalchemy import update as sql_update
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError

from jobfence.locks.backends.redis_scripts import load_scripts
from jobfence.locks.errors import LockError, StaleFence
from jobfence.locks.keys import KeySpace
from jobfence.locks.sql import create_tables, ensure_tables

metadata = MetaData()
fences = Table(
    "jobfence_fences",
    metadata,
    Column("resource", String(255), primary_key=True),
    Column("fence", BigInteger, nullable=False),
)


def _check_args(resource: str, fence: int) -> None:
    if not isinstance(resource, str) or not resource or len(resource) > 255:
        raise LockError(f"resource must be a string of 1..255 characters, got {resource!r}")
    # SQL keeps fences in a signed BIGINT; refuse what it cannot hold rather than fail there.
    if not isinstance(fence, int) or isinstance(fence, bool) or not 0 <= fence < 2**63:
        raise LockError(
            f"fence must be an int in [0, 2**63) (lease.fence), got {fence!r}", key=resource
        )


class SqlFenceGuard:
    """Keeps the highest accepted token per resource in `jobfence_fences`.

    Call `check_and_advance` first inside the transaction that writes the resource,
    and let StaleFence propagate: the transaction rolls back and nothing is written.
    PostgreSQL and SQLite use one conditional upsert; MySQL/MariaDB an upsert keeping
    the greater token, then a locking read; other dialects an UPDATE, then an INSERT
    under a savepoint. The table is created on first use (or by `jobfence migrate`).
    """

    table = fences

    def create_schema(self, engine: Engine) -> list[str]:
        """Create the fence table if it is missing; the names of the tables created."""
        return create_tables(engine, [self.table])

    def check_and_advance(self, conn: Connection, resource: str, fence: int) -> None:
        _check_args(resource, fence)
        ensure_tables(conn, [self.table])
        dialect = conn.dialect.name
        if dialect in ("postgresql", "sqlite"):
            ins = (pg_insert if dialect == "postgresql" else sqlite_insert)(self.table)
            stmt = ins.values(resource=resource, fence=fence).on_conflict_do_update(
                index_elements=[self.table.c.resource],
                set_={"fence": ins.excluded.fence},
                where=self.table.c.fence <= ins.excluded.fence,
            )
            if conn.execute(stmt.execution_options(preserve_rowcount=True)).rowcount == 1:
                return
            self._stale(conn, resource, fence)
        if dialect in ("mysql", "mariadb"):
            # One upsert: an UPDATE that misses takes a gap lock, and two such transactions
            # inserting into one gap deadlock under REPEATABLE READ.
            mins = mysql_insert(self.table).values(resource=resource, fence=fence)
            conn.execute(
                mins.on_duplicate_key_update(
                    fence=func.greatest(self.table.c.fence, mins.inserted.fence)
                )
            )
            last = conn.execute(
                select(self.table.c.fence)
                .where(self.table.c.resource == resource)
                .with_for_update()
            ).scalar_one()
            if int(last) > fence:
                raise StaleFence(resource=resource, fence=fence, last=int(last))
            return
        for _ in range(3):
            if self._advance(conn, resource, fence):
                return
            if self._last(conn, resource) is not None:
                self._stale(conn, resource, fence)
            try:
                with conn.begin_nested():
                    conn.execute(self.table.insert().values(resource=resource, fence=fence))
                return
            except IntegrityError:
                continue  # another transaction inserted it first: compare against theirs
        self._stale(conn, resource, fence)

    def last(self, conn: Connection, resource: str) -> int | None:
        """The highest token accepted so far for `resource`."""
        ensure_tables(conn, [self.table])
        return self._last(conn, resource)

    @contextmanager
    def transaction(self, engine: Engine, resource: str, fence: int) -> Iterator[Connection]:
        """A transaction whose token is checked first: `with guard.transaction(...) as conn:`."""
        ensure_tables(engine, [self.table])
        with engine.begin() as conn:
            self.check_and_advance(conn, resource, fence)
            yield conn

    def _advance(self, conn: Connection, resource: str, fence: int) -> bool:
        stmt = (
            sql_update(self.table)
            .where(self.table.c.resource == resource, self.table.c.fence <= fence)
            .values(fence=fence)
        )
        return bool(conn.execute(stmt).rowcount)

    def _last(self, conn: Connection, resource: str) -> int | None:
        value = conn.execute(
            select(self.table.c.fence).where(self.table.c.resource == resource)
        ).scalar_one_or_none()
        return None if value is None else int(value)

    def _stale(self, conn: Connection, resource: str, fence: int) -> None:
        raise StaleFence(resource=resource, fence=fence, last=self._last(conn, resource))


class RedisFenceGuard:
    """Fenced writes on Redis: one Lua script checks the token, advances it, then writes."""

    def __init__(self, client: Redis, *, prefix: str = "jobfence") -> None:
        self.client = client
        self.keys = KeySpace(prefix)
        self.script = load_scripts(client)["fenced_write"]

    def write(
        self,
        resource: str,
        fence: int,
        commands: Sequence[Sequence[str | int | float]],
        *,
        keys: Sequence[str] | None = None,
    ) -> list[Any]:
        """Run `commands` (e.g. [("HSET", "acct:1", "balance", 90)]) if `fence` is not stale.

        Returns the replies of the commands. Raises StaleFence (nothing written) otherwise.
        `keys` lists the keys written; by default each command's first argument.
        """
        _check_args(resource, fence)
        touched = list(keys) if keys is not None else [str(c[1]) for c in commands if len(c) > 1]
        reply = self.script(
            keys=[self.keys.resource_fence(resource), *touched],
            args=[fence, json.dumps([[str(a) for a in c] for c in commands])],
        )
        if int(reply[0]) == 0:
            raise StaleFence(resource=resource, fence=fence, last=int(reply[1]))
        return list(reply[2:])

    def last(self, resource: str) -> int | None:
        value = self.client.get(self.keys.resource_fence(resource))
        return None if value is None else int(value)
