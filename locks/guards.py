"""Fence guards: check-and-advance a resource's fencing token inside the caller's transaction."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from redis import ConnectionPool, Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
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

# Lane sends on a pool's connections and never re-sends a command that went out.
from jobfence.locks.backends.redis.lane import Lane
from jobfence.locks.backends.redis.scripts import load_scripts, script_source
from jobfence.locks.errors import (
    BackendUnavailable,
    CommitOutcomeUnknown,
    FencedWriteRefused,
    LockError,
    PartialFencedWrite,
    StaleFence,
    StaleFenceOutcomeUnknown,
)
from jobfence.locks.keys import KeySpace
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


def _check_args(resource: str, fence: int) -> None:
    if not isinstance(resource, str) or not resource or len(resource) > 255:
        raise LockError(f"resource must be a string of 1..255 characters, got {resource!r}")
    # SQL keeps fences in a signed BIGINT; refuse what it cannot hold rather than fail there.
    if not isinstance(fence, int) or isinstance(fence, bool) or not 0 <= fence < 2**63:
        raise LockError(
            f"fence must be an int in [0, 2**63) (lease.fence), got {fence!r}", key=resource
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
        _check_args(resource, fence)
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
        _check_args(resource, fence)
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


class _FencedWrites:
    """What the sync and asyncio Redis fence guards share: the checks and the script's
    keys and arguments (the reply: `_outcome`)."""

    client: Any
    keys: KeySpace

    def _request(
        self,
        resource: str,
        fence: int,
        commands: Sequence[Sequence[str | int | float]],
        write_id: str,
        keys: Sequence[str] | None,
        record: JobRecordArgs | None = None,
    ) -> tuple[list[str], list[Any]]:
        """fenced_write.lua's keys and arguments, after checking them; with `record`, the
        job's DONE record is read first and written with the commands."""
        _check_args(resource, fence)
        if not isinstance(write_id, str) or len(write_id) > 255:
            raise LockError("write_id must be a string of at most 255 characters", key=resource)
        touched = list(keys) if keys is not None else [str(c[1]) for c in commands if len(c) > 1]
        self._check_one_slot(resource, fence, touched)
        body = json.dumps([[_arg(a) for a in c] for c in commands])
        k = self.keys
        if record is None:
            return [k.resource_fence(resource), k.resource_writes(resource), *touched], [
                fence, write_id, body,
            ]  # fmt: skip
        name = k.effect_record(resource, record.key)
        return [k.resource_fence(resource), k.resource_writes(resource), name, *touched], [
            fence, write_id, body, record.fingerprint, record.result, record.ttl_ms,
        ]  # fmt: skip

    def _check_one_slot(self, resource: str, fence: int, touched: list[str]) -> None:
        """On a cluster client (it has `keyslot`), refuse keys outside the resource's slot:
        the script must run where its fence lives, and a cluster runs it in one slot."""
        keyslot = getattr(self.client, "keyslot", None)
        if keyslot is None:
            return
        home = keyslot(self.keys.resource_fence(resource))
        for index, name in enumerate(touched, 1):
            if keyslot(name) != home:
                raise FencedWriteRefused(
                    resource=resource, fence=fence, index=None,
                    reason=f"key {index} of the write is in another hash slot than its "
                    "resource's, and on a Redis Cluster a fenced write runs in one slot; put "
                    "the resource in braces in the key's name, "
                    f"e.g. 'balance:{{{resource}}}'",
                )  # fmt: skip


class RedisFenceGuard(_FencedWrites):
    """Fenced writes on Redis: one Lua script checks the token, advances it, then writes.

    A write is idempotent per (resource, fence, write id): a resend after a lost reply
    returns the first answer and applies nothing. The first reply is kept beside the
    resource's fence until the fence advances. Under one fence, each distinct write needs
    its own `write_id`; the default ("") allows one write per fence.

    The client's own retries are never used (redis-py retries by default, and a blind
    resend of a non-idempotent script applied it twice): a plain `redis.Redis` is driven
    through connections of its pool that never re-send, and the guard re-sends itself,
    `resends` times, safely. Another client type (a cluster client) is refused if it
    retries. Known commands are checked first, inside the script: a write one of them
    would fail (wrong type, not an integer, arity) is refused whole (FencedWriteRefused);
    an error the check cannot foresee raises PartialFencedWrite saying what was applied.
    """

    def __init__(self, client: Redis, *, prefix: str = "jobfence", resends: int = 2) -> None:
        if not isinstance(resends, int) or isinstance(resends, bool) or resends < 0:
            raise LockError(f"resends must be an int >= 0, got {resends!r}")
        self.client = client
        self.keys = KeySpace(prefix)
        self.resends = resends
        self.script = load_scripts(client)["fenced_write"]
        pool = getattr(client, "connection_pool", None)
        if type(client) is Redis and isinstance(pool, ConnectionPool):
            self._lane: Lane | None = Lane(pool)
        else:
            self._lane = None
            _refuse_retrying(client)

    def write(
        self,
        resource: str,
        fence: int,
        commands: Sequence[Sequence[str | int | float]],
        *,
        write_id: str = "",
        keys: Sequence[str] | None = None,
    ) -> list[Any]:
        """Run `commands` (e.g. [("HSET", "acct:1", "balance", 90)]) if `fence` is not stale.

        Returns the replies of the commands; a resend of the same (resource, fence,
        write_id) returns the first replies and applies nothing. Raises StaleFence
        (nothing written), FencedWriteRefused (nothing written: a command would fail, or
        `write_id` was used under this fence with other commands) or PartialFencedWrite.
        `keys` lists the keys written; by default each command's first argument.
        """
        script_keys, args = self._request(resource, fence, commands, write_id, keys)
        reply, lost = self._send(resource, fence, script_keys, args)
        return _outcome(resource, fence, reply, lost)

    def write_recorded(
        self,
        resource: str,
        fence: int,
        commands: Sequence[Sequence[str | int | float]],
        record: JobRecordArgs,
        *,
        keys: Sequence[str] | None = None,
    ) -> RecordedWrite:
        """`write`, and the job's DONE record (`record`) in the same script, beside the
        resource: if the record is there already, the job took effect before (a re-run
        granted again after the lock server lost its data, a resend after a lost reply) and
        nothing is applied; its stored result answers. A fence guard alone refuses older
        fences, never a re-run under a newer one: this refuses both."""
        script_keys, args = self._request(resource, fence, commands, "", keys, record)
        reply, lost = self._send(resource, fence, script_keys, args)
        return _recorded(resource, fence, reply, lost, record)

    def advance(self, resource: str, fence: int) -> int:
        """Raise the resource's floor to `fence` (no write); return the floor now in force.

        After a forced release, this makes a dead or frozen holder's writes fail at once.
        """
        try:
            self.write(resource, fence, [], write_id="jobfence:advance")
        except StaleFence as exc:
            assert exc.last is not None
            return exc.last
        return fence

    def last(self, resource: str) -> int | None:
        value = self.client.get(self.keys.resource_fence(resource))
        return None if value is None else int(value)

    def _send(
        self, resource: str, fence: int, keys: list[str], args: list[Any]
    ) -> tuple[list[Any], bool]:
        """The script's reply, and whether an earlier attempt's reply was lost."""
        lost: RedisError | None = None
        for _ in range(self.resends + 1):
            try:
                return list(self._evalsha(keys, args)), lost is not None
            except (RedisConnectionError, RedisTimeoutError) as exc:
                lost = exc  # the script may have run: only a resend tells, and it is safe
            except ResponseError as exc:
                raise _refused_by_server(resource, fence, exc) from exc
        raise _unknown_after_resends(resource, fence, self.resends, lost)

    def _evalsha(self, keys: list[str], args: list[Any]) -> Any:
        script = self.script
        for attempt in (1, 2):
            try:
                if self._lane is not None:
                    return self._lane.call("EVALSHA", script.sha, len(keys), *keys, *args)
                return self.client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                if attempt == 2:
                    raise
                script.sha = self.client.script_load(script.script)
        raise AssertionError("unreachable")


def _arg(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise LockError(
            f"fenced write arguments must be str, int, float or bytes, got {type(value).__name__}"
        )
    return str(value)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _outcome(resource: str, fence: int, reply: list[Any], lost: bool) -> list[Any]:
    """fenced_write.lua's reply: the commands' replies, or the refusal raised."""
    code = int(reply[0])
    if code in (1, 2):
        return list(reply[2:])
    if code == 0:
        error = StaleFenceOutcomeUnknown if lost else StaleFence
        raise error(resource=resource, fence=fence, last=int(reply[1]))
    if code == 3:
        raise FencedWriteRefused(
            resource=resource, fence=fence, index=int(reply[1]), reason=_text(reply[2])
        )
    if code == 4:
        raise FencedWriteRefused(
            resource=resource, fence=fence, index=None,
            reason="this write_id was used under this fence with other commands",
        )  # fmt: skip
    raise PartialFencedWrite(
        resource=resource,
        fence=fence,
        index=int(reply[2]),
        reason=_text(reply[3]),
        replies=list(reply[4:]),
    )


@dataclass(frozen=True)
class JobRecordArgs:
    """The DONE record a recorded fenced write stores with its commands (RedisEffects)."""

    key: str  # the job's idempotency key
    fingerprint: str  # its arguments' fingerprint: another one under the key is refused
    result: str  # the job's result, as JSON
    ttl_ms: int = 0  # how long the record is kept (0: for ever)


@dataclass(frozen=True)
class RecordedWrite:
    """What a recorded fenced write did: applied now (the commands' `replies`), or not
    because the job's DONE record was there (`result` is the one it stored, under `fence`)."""

    applied: bool
    fence: int
    result: str
    replies: list[Any]


def _recorded(
    resource: str, fence: int, reply: list[Any], lost: bool, record: JobRecordArgs
) -> RecordedWrite:
    code = int(reply[0])
    if code == 6:
        return RecordedWrite(False, int(reply[1]), _text(reply[2]), [])
    if code == 7:
        raise FencedWriteRefused(
            resource=resource, fence=fence, index=None,
            reason="the job key's DONE record beside this resource holds other arguments "
            "(a key reused with different arguments): use a new key or the original arguments",
        )  # fmt: skip
    return RecordedWrite(True, fence, record.result, _outcome(resource, fence, reply, lost))


def _refused_by_server(resource: str, fence: int, exc: ResponseError) -> FencedWriteRefused:
    # An error out of the script itself (not a command's: those are caught in it), e.g.
    # out of memory. The server checks memory at a script's first write only, and every
    # write but the commands' comes after them or is the first: so nothing was written.
    return FencedWriteRefused(
        resource=resource, fence=fence, index=None, reason=f"the server refused it: {exc}"
    )


def _unknown_after_resends(
    resource: str, fence: int, resends: int, lost: BaseException | None
) -> BackendUnavailable:
    return BackendUnavailable(
        f"fenced write outcome unknown after {resends + 1} attempts; resend it with "
        "the same fence and write_id to learn it (a resend never applies twice)",
        key=resource,
        fence=fence,
        cause=lost,
    )


class AsyncRedisFenceGuard(_FencedWrites):
    """RedisFenceGuard for asyncio: the same script, checks and replies, sent through a
    `redis.asyncio.Redis` client that must not retry on its own (the guard re-sends).

        guard = AsyncRedisFenceGuard(redis.asyncio.Redis.from_url(url, retry=Retry(NoBackoff(), 0)))
        await guard.write("acct:1", lease.fence, [("HSET", "acct:1", "balance", 90)])
    """

    def __init__(self, client: Any, *, prefix: str = "jobfence", resends: int = 2) -> None:
        if not isinstance(resends, int) or isinstance(resends, bool) or resends < 0:
            raise LockError(f"resends must be an int >= 0, got {resends!r}")
        _refuse_retrying(client)
        self.client = client
        self.keys = KeySpace(prefix)
        self.resends = resends
        self.source = script_source("fenced_write")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def write(
        self,
        resource: str,
        fence: int,
        commands: Sequence[Sequence[str | int | float]],
        *,
        write_id: str = "",
        keys: Sequence[str] | None = None,
    ) -> list[Any]:
        """As RedisFenceGuard.write, awaited: StaleFence if `fence` is stale (nothing written)."""
        script_keys, args = self._request(resource, fence, commands, write_id, keys)
        lost: RedisError | None = None
        for _ in range(self.resends + 1):
            try:
                reply = await self._evalsha_async(script_keys, args)
                return _outcome(resource, fence, list(reply), lost is not None)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                lost = exc  # the script may have run: only a resend tells, and it is safe
            except ResponseError as exc:
                raise _refused_by_server(resource, fence, exc) from exc
        raise _unknown_after_resends(resource, fence, self.resends, lost)

    async def _evalsha_async(self, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.sha = await self.client.script_load(self.source)
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)

    async def last(self, resource: str) -> int | None:
        value = await self.client.get(self.keys.resource_fence(resource))
        return None if value is None else int(value)


def _refuse_retrying(client: Any) -> None:
    """Refuse a client that would re-send a command on its own after a timeout."""
    get_retry = getattr(client, "get_retry", None)
    retry = get_retry() if callable(get_retry) else None
    retries = retry.get_retries() if retry is not None else 0
    if retries:
        raise LockError(
            "RedisFenceGuard needs a client that does not retry on its own "
            f"({type(client).__name__} retries {retries} times): build it with "
            "retry=Retry(NoBackoff(), 0) (redis.retry, redis.backoff); the guard re-sends "
            "itself, safely, with the same fence and write id"
        )
