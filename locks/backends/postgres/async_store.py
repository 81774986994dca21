"""The asyncio PostgreSQL store: psycopg's async connections with the sync store's statements."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, ClassVar

import psycopg
from psycopg import errors as pgerrors

from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    NativeAsyncStore,
    settle_extensions,
    validate_key,
    validate_ttl,
)
from jobfence.locks.backends.postgres.backend import PostgresBackend
from jobfence.locks.backends.postgres.connection import OPTIONS_FIX, SERVER_PID, options_refused
from jobfence.locks.backends.postgres.protocol import (
    begin_params,
    commit_params,
    extend_params,
    parse_begin,
    parse_extend,
    parse_job_record,
    wake_params,
)
from jobfence.locks.backends.postgres.statements import (
    BEGIN,
    COMMIT,
    EXTEND_MANY,
    JOB_RECORD,
    RELEASE,
)
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import Lease, OwnerMeta
from jobfence.locks.ops import (
    Acquire,
    Begin,
    Commit,
    Extend,
    ReadRecord,
    Release,
    ReleaseOwner,
    StoreOp,
    WaitRelease,
)
from jobfence.locks.slots import SlotLease

#: Connections open at once: more ops in flight wait for one (a connect storm of hundreds of
#: coroutines would time out, and each is a server process).
MAX_CONNECTIONS = 16


class AsyncPostgresStore(NativeAsyncStore):
    """Locks in the PostgreSQL lease table for asyncio: acquire, extend and release, and a
    job's begin, commit and record read, are one awaited statement each on psycopg's
    AsyncConnection, the very statements (and the parameters and answers) PostgresBackend
    sends, so sync and async holders of one key exclude each other and share one fence
    sequence and one record space.

    Semaphores, rate limits, inspection, the publish claim and the delivery count run the
    sync backend (`backend`) in a worker thread; a waiter polls with its backoff
    (asyncio.sleep) rather than hold a connection in LISTEN. Its leases name `backend`, so
    `lease.release()` from a thread still works.
    """

    backend: PostgresBackend  # the sync twin (NativeAsyncStore)
    name: ClassVar[str] = "postgres"
    capabilities: ClassVar[Capabilities] = PostgresBackend.capabilities

    def __init__(self, backend: PostgresBackend) -> None:
        self.backend = backend
        self.clock = backend.clock
        self.prefix = backend.prefix
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)

    @classmethod
    def from_url(
        cls, url: str, *, clock: Clock = SYSTEM_CLOCK, **options: Any
    ) -> AsyncPostgresStore:
        return cls(PostgresBackend.from_url(url, clock=clock, **options))

    async def _run(
        self, what: str, key: str | None, sql: str, params: Any
    ) -> list[tuple[Any, ...]]:
        """One statement, one round trip, as PostgresBackend._run; BackendUnavailable on error."""
        async with self._slots:
            return await self._run_on_a_connection(what, key, sql, params)

    async def _run_on_a_connection(
        self, what: str, key: str | None, sql: str, params: Any
    ) -> list[tuple[Any, ...]]:
        for attempt in (0, 1):
            if not self.backend._ready:
                await asyncio.to_thread(self.backend.create_tables)
            conn = self._idle.pop() if self._idle else None
            try:
                if conn is None or conn.closed:
                    conn = await self._connect()
                cur = await conn.execute(sql, params, prepare=True)
                rows = await cur.fetchall() if cur.description else [(cur.rowcount,)]
            except psycopg.Error as exc:
                if conn is not None and conn.broken:
                    await conn.close()
                if attempt == 0 and isinstance(exc, pgerrors.UndefinedTable):
                    self.backend._ready = False  # the tables vanished: make them, run again
                    continue
                raise BackendUnavailable(
                    f"postgres {what} failed on {self.backend._shown}", key=key, cause=exc
                ) from exc
            except BaseException:
                if conn is not None:  # cancelled mid-statement: its state is unknown
                    await asyncio.shield(conn.close())
                raise
            if not conn.closed:
                self._idle.append(conn)
            return rows
        raise AssertionError("unreachable")

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        """A new connection; behind a pooler (as PostgresBackend._connect tells it) one that
        never prepares a statement."""
        try:
            conn = await psycopg.AsyncConnection.connect(self.backend.conninfo, autocommit=True)
        except psycopg.OperationalError as exc:
            if options_refused(exc):
                raise psycopg.OperationalError(f"{OPTIONS_FIX}: {exc}") from exc
            raise
        try:
            cur = await conn.execute(SERVER_PID, prepare=False)
            row = await cur.fetchone()
        except BaseException:
            await asyncio.shield(conn.close())
            raise
        self.backend.pooled = row is None or int(row[0]) != conn.info.backend_pid
        if self.backend.pooled:
            conn.prepare_threshold = None  # as connection.without_session_state
        return conn

    async def execute_async(self, op: StoreOp) -> Any:
        """One op (locks/ops.py); the replies are PostgresBackend.execute's."""
        match op:
            case Begin():
                return await self.begin_op(op)
            case Commit():
                return await self.commit_op(op)
            case Acquire(key, ttl, owner, meta):
                return await self._begin(key, ttl, owner, meta, False, "")
            case ReadRecord(key):
                validate_key(key)
                return parse_job_record(await self._run("job_record", key, JOB_RECORD,
                                                        (self.prefix, key)))  # fmt: skip
            case WaitRelease(_, timeout):
                await asyncio.sleep(timeout)
                return None
            case Extend(leases) if not any(type(le) is SlotLease for le in leases):
                return await self._extend_leases(leases)
            case Release(lease) if type(lease) is not SlotLease:
                return await self._release_lease(lease)
            case ReleaseOwner(key, owner):
                validate_key(key)
                return await self._release(key, owner)
        # Slots, rate limits, inspection, the publish claim, the delivery count: the sync
        # backend, in a worker thread.
        return await self._in_thread(op)

    async def _extend_leases(self, leases: Sequence[Lease]) -> list[bool]:
        """Extend lock leases (no slot among them) in one statement, as extend_many does."""
        if not leases:
            return []
        started = self.clock.monotonic()
        items = [(le.key, le.owner, validate_ttl(le.ttl)) for le in leases]
        rows = await self._run("extend_many", None, EXTEND_MANY, extend_params(self.prefix, items))
        return settle_extensions(leases, parse_extend(items, rows), started)

    async def _release_lease(self, lease: Lease) -> bool:
        """Release a lock lease once: a second release answers False, sending nothing."""
        if lease.released:
            return False
        try:
            return await self._release(lease.key, lease.owner)
        finally:
            lease._released = True

    async def _in_thread(self, op: StoreOp) -> Any:
        """`op` run by the sync backend in a worker thread; a cancel waits for its effect."""
        job = asyncio.ensure_future(asyncio.to_thread(self.backend.execute, op))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            await asyncio.wait([job])  # its effect lands first; the flow then undoes it
            raise

    async def _grant(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        params = begin_params(self.prefix, key, owner, ttl_ms, meta, record, fingerprint,
                              self.backend.fence_floor)  # fmt: skip
        got = parse_begin((await self._run("begin", key, BEGIN, params))[0])
        if isinstance(got, int) and got > self.backend.fence_floor:
            self.backend.fence_floor = got
        return got

    async def _commit(self, rec: CommitRecord) -> bool:
        params = wake_params(self.prefix, rec.key, commit_params(rec))
        return bool((await self._run("commit", rec.key, COMMIT, params))[0][0])

    async def _release(self, key: str, owner: str) -> bool:
        params = wake_params(self.prefix, key, {"owner": owner})
        return bool((await self._run("release", key, RELEASE, params))[0][0])

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()
        await asyncio.to_thread(self.backend.close)
