"""Fence guards in SQL: check-and-advance a resource's fencing token inside the caller's
transaction (SQLAlchemy, sync and asyncio)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, cast

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Executable,
    MetaData,
    Select,
    String,
    Table,
    func,
    select,
)
from sqlalchemy import update as sql_update
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError

from jobfence.locks.errors import CommitOutcomeUnknown, LockError, StaleFence
from jobfence.locks.guards.args import check_args
from jobfence.locks.sql import (
    connection_lost,
    create_tables,
    ensure_tables,
    link_lost,
    transaction_on_own_connection,
)

if TYPE_CHECKING:  # sqlalchemy.ext.asyncio needs greenlet at run time, the asyncio guard only
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

metadata = MetaData()
fences = Table(
    "jobfence_fences",
    metadata,
    Column("resource", String(255), primary_key=True),
    Column("fence", BigInteger, nullable=False),
)


UPSERT_DIALECTS = ("postgresql", "sqlite")  # one conditional upsert checks and advances


def advance_upsert(table: Table, dialect: str, resource: str, fence: int) -> Executable:
    """The check and the advance in one statement (PostgreSQL, SQLite): its rowcount is 1
    if `fence` was accepted (>= the last one), 0 if stale. Sync and asyncio guards send it."""
    ins = (pg_insert if dialect == "postgresql" else sqlite_insert)(table)
    stmt = ins.values(resource=resource, fence=fence).on_conflict_do_update(
        index_elements=[table.c.resource],
        set_={"fence": ins.excluded.fence},
        where=table.c.fence <= ins.excluded.fence,
    )
    return stmt.execution_options(preserve_rowcount=True)


def last_fence(table: Table, resource: str) -> Select[tuple[int]]:
    """The highest fence accepted so far for `resource` (no row: none yet)."""
    return select(table.c.fence).where(table.c.resource == resource)


def _int(value: object) -> int | None:
    return None if value is None else int(cast(int, value))


def commit_unknown(
    resource: str, fence: int, exc: BaseException, *, at_commit: bool = True
) -> CommitOutcomeUnknown:
    """The connection was lost in a fenced transaction: before COMMIT nothing committed; at
    COMMIT no record here says whether the writes landed. Either way a job comes back to
    see (never a plain body failure)."""
    before = "inside the fenced transaction, before its COMMIT: nothing committed"
    where = "at the fenced transaction's COMMIT" if at_commit else before
    return CommitOutcomeUnknown(
        f"the connection was lost {where}", key=resource, fence=fence, reason=type(exc).__name__
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
        check_args(resource, fence)
        ensure_tables(conn, [self.table])
        dialect = conn.dialect.name
        if dialect in UPSERT_DIALECTS:
            if conn.execute(advance_upsert(self.table, dialect, resource, fence)).rowcount == 1:
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
        """A transaction whose token is checked first: `with guard.transaction(...) as conn:`.

        The connection lost anywhere in it (a statement, the COMMIT) raises
        `CommitOutcomeUnknown` (a job delivers again), never a plain database error that
        would read as the body failing."""

        def settle(lost: Exception, at_commit: bool) -> None:
            raise commit_unknown(resource, fence, lost, at_commit=at_commit) from lost

        with transaction_on_own_connection(engine, [self.table], settle) as conn:
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
        return _int(conn.execute(last_fence(self.table, resource)).scalar_one_or_none())

    def _stale(self, conn: Connection, resource: str, fence: int) -> None:
        raise StaleFence(resource=resource, fence=fence, last=self._last(conn, resource))


class AsyncSqlFenceGuard:
    """SqlFenceGuard on SQLAlchemy's asyncio engine (`create_async_engine`), PostgreSQL only
    (`postgresql+psycopg://`, psycopg 3's async connection; SQLAlchemy's asyncio needs
    greenlet: `pip install 'jobfence[asyncio-sql]'`). The same table, statement and verdict
    as SqlFenceGuard, so sync and asyncio writers of one resource share its fence row.

    Call `check_and_advance` first inside the transaction that writes the resource and let
    StaleFence propagate, or write inside `async with guard.transaction(engine, ...)`.
    """

    table = fences

    async def create_schema(self, engine: AsyncEngine) -> list[str]:
        """Create the fence table if it is missing; the names of the tables created."""
        async with engine.begin() as conn:
            await conn.run_sync(ensure_tables, [self.table])
        return [self.table.name]

    async def check_and_advance(self, conn: AsyncConnection, resource: str, fence: int) -> None:
        check_args(resource, fence)
        dialect = conn.dialect.name
        if dialect != "postgresql":
            raise LockError(
                f"AsyncSqlFenceGuard runs on PostgreSQL only, not {dialect}: use a "
                "postgresql+psycopg:// async engine, or SqlFenceGuard in a worker thread "
                "(await asyncio.to_thread(...))",
                key=resource,
            )
        await conn.run_sync(ensure_tables, [self.table])
        result = await conn.execute(advance_upsert(self.table, dialect, resource, fence))
        if result.rowcount != 1:
            raise StaleFence(resource=resource, fence=fence, last=await self._last(conn, resource))

    async def last(self, conn: AsyncConnection, resource: str) -> int | None:
        """The highest token accepted so far for `resource`."""
        await conn.run_sync(ensure_tables, [self.table])
        return await self._last(conn, resource)

    @asynccontextmanager
    async def transaction(
        self, engine: AsyncEngine, resource: str, fence: int
    ) -> AsyncIterator[AsyncConnection]:
        """A transaction whose token is checked first: `async with guard.transaction(...)
        as conn:`; a connection lost anywhere in it raises CommitOutcomeUnknown."""
        try:
            conn = await engine.connect()
        except (OperationalError, InterfaceError) as exc:  # unreachable: nothing began
            raise commit_unknown(resource, fence, exc, at_commit=False) from exc
        try:
            trans = await conn.begin()
            try:
                await self.check_and_advance(conn, resource, fence)
                yield conn
            except BaseException as exc:
                lost = conn.sync_connection is not None and connection_lost(
                    exc, conn.sync_connection
                )
                try:
                    await trans.rollback()
                except DBAPIError:
                    if not lost:
                        raise
                if lost:
                    raise commit_unknown(resource, fence, exc, at_commit=False) from exc
                raise
            try:
                await trans.commit()
            except DBAPIError as exc:  # the link died at COMMIT (a timeout's is InternalError)
                if isinstance(exc, (OperationalError, InterfaceError)) or link_lost(exc):
                    raise commit_unknown(resource, fence, exc) from exc
                raise
        finally:
            await conn.close()

    async def _last(self, conn: AsyncConnection, resource: str) -> int | None:
        return _int((await conn.execute(last_fence(self.table, resource))).scalar_one_or_none())
