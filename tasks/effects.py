"""Layer 3 in SQL: a job's effect and its DONE row commit in one fenced transaction."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    make_url,
    select,
)
from sqlalchemy.exc import InterfaceError, OperationalError

from jobfence.locks.errors import CommitOutcomeUnknown
from jobfence.locks.guards import SqlFenceGuard, fences
from jobfence.locks.sql import (
    connection_lost,
    create_tables,
    dispose_after_fork,
    ensure_tables,
    transaction_on_own_connection,
)
from jobfence.tasks.context import JobContext
from jobfence.tasks.errors import IdempotencyConflict
from jobfence.tasks.keys import canonical_json

if TYPE_CHECKING:
    from sqlalchemy.orm import Session  # only a caller's: the ORM is not loaded for it

metadata = MetaData()
jobs = Table(
    "jobfence_jobs",
    metadata,
    Column("job_key", String(255), primary_key=True),
    Column("state", String(16), nullable=False),
    Column("fingerprint", String(64), nullable=False),
    Column("result", Text, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("finished_at", Float, nullable=False),
)
#: One row per message published on commit (tasks/outbox.py): written in the caller's
#: transaction, marked sent once published, pruned by the relay.
outbox = Table(
    "jobfence_outbox",
    metadata,
    Column("task_id", String(64), primary_key=True),
    Column("task_name", String(255), nullable=False),
    Column("payload", Text, nullable=False),  # {"args", "kwargs", "options"} as JSON
    Column("created_at", Float, nullable=False),
    Column("sent_at", Float, nullable=True),
    Column("attempts", Integer, nullable=False, default=0),
    Index("jobfence_outbox_unsent", "sent_at", "created_at"),
)
#: Where a Session keeps the callbacks waiting for its root transaction's commit.
_PENDING = "jobfence_after_commit"
#: Every table jobfence keeps in SQL, in creation order (`jobfence migrate` makes these).
TABLES: tuple[Table, ...] = (fences, jobs, outbox)


def make_engine(url: str, **options: Any) -> Engine:
    """An engine fit for several worker processes; SQLite gets WAL and BEGIN IMMEDIATE,
    psycopg no prepared statements (safe behind a transaction pooler such as PgBouncer).

    With pysqlite's deferred transactions two writers that both read first deadlock on
    the upgrade and one fails at once; BEGIN IMMEDIATE makes them queue instead. A child
    forked from this process gets a fresh pool (see `locks.sql.dispose_after_fork`).
    """
    if not url.startswith("sqlite"):
        driver = make_url(url).get_driver_name()
        if driver == "pymysql":
            return dispose_after_fork(_tls_first_mysql(create_engine(url, pool_pre_ping=True,
                                                                     **options)))  # fmt: skip
        if driver == "psycopg":
            # psycopg prepares a statement after 5 runs: session state that a transaction
            # pooler (PgBouncer) mixes up between clients, so never (docs/how-to/backends/sql.md).
            options["connect_args"] = {"prepare_threshold": None,
                                       **options.get("connect_args", {})}  # fmt: skip
        return dispose_after_fork(create_engine(url, pool_pre_ping=True, **options))
    engine = create_engine(url, connect_args={"timeout": 30, "isolation_level": None}, **options)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return dispose_after_fork(engine)


def _tls_first_mysql(engine: Engine) -> Engine:
    """PyMySQL connections whose TLS options read as the lock URL's, refused before the
    login when TLS is asked for and the server offers none (PyMySQL 1.1 sent the password
    in clear text there)."""
    from jobfence.locks.backends.mysql import connect_for_sqlalchemy  # PyMySQL: on use

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> Any:
        return connect_for_sqlalchemy("the database URL (JOBFENCE_DATABASE_URL)", **cparams)

    return engine


@dataclass
class EffectTx:
    """The open transaction. If `done`, the job already took effect: return `result`."""

    conn: Connection
    done: bool
    result: Any = None


class SqlEffects:
    """Fenced, exactly-once effects in one SQL database.

        with effects.transaction(job, f"account:{account}") as tx:
            if tx.done:
                return tx.result
            tx.conn.execute(...)          # the effect
            tx.result = {...}             # stored with the DONE row
        return tx.result

    Each resource's fence is checked and advanced first (StaleFence rolls everything
    back); the DONE row is inserted in the same transaction, so a second execution of
    the job finds it, and two racing executions collide on its primary key. The fence and
    job tables are created on first use; `create_schema()` (or `jobfence migrate`) does it
    ahead of time.

    With `session=` the transaction is a savepoint in the caller's Session: the effect
    commits when the caller commits, and the lock server's record waits for that commit
    (none on rollback). A connection lost inside the transaction (a restart, a failover,
    a killed session) committed nothing: `CommitOutcomeUnknown`, and the job is delivered
    again, never failed. Lost at COMMIT, the DONE row is read on a fresh connection: there,
    the transaction landed; else `CommitOutcomeUnknown`. A user's own error (an integrity
    error on a live connection) rolls back and fails the job as before.
    """

    def __init__(self, engine: Engine, *, guard: SqlFenceGuard | None = None) -> None:
        self.engine = dispose_after_fork(engine)
        self.guard = guard or SqlFenceGuard()

    def create_schema(self) -> list[str]:
        """Create the missing jobfence tables now; the names of the tables created."""
        return create_tables(self.engine, TABLES)

    @contextmanager
    def transaction(
        self, job: JobContext, *resources: str, session: Session | None = None
    ) -> Iterator[EffectTx]:
        if session is not None:
            with self._in_session(job, resources, session) as nested:
                yield nested
            return
        tx: EffectTx | None = None

        def settle(lost: Exception, at_commit: bool) -> None:
            self._settle(job, tx, lost, at_commit)

        with transaction_on_own_connection(self.engine, TABLES, settle) as conn:
            tx = self._open(conn, job, resources)
            yield tx
            self._close(tx, job)

    @contextmanager
    def _in_session(
        self, job: JobContext, resources: tuple[str, ...], session: Session
    ) -> Iterator[EffectTx]:
        """A savepoint in the caller's Session; the lock server's record waits for the
        caller's commit of the transaction it is in now."""
        conn: Connection | None = None
        try:
            with session.begin_nested():
                conn = session.connection()
                ensure_tables(conn, TABLES)
                tx = self._open(conn, job, resources)
                yield tx
                self._close(tx, job)
        except Exception as exc:  # the caller's transaction is gone with its connection
            if conn is not None and connection_lost(exc, conn):
                self._settle(job, None, exc, at_commit=False)
            raise
        # A replay too: the DONE row it read may be this transaction's own, uncommitted.
        _after_commit(session, job.join_outer().commit)

    def _open(self, conn: Connection, job: JobContext, resources: tuple[str, ...]) -> EffectTx:
        for resource, fence in job.guarded_rows(resources):  # one order: no deadlocks
            self.guard.check_and_advance(conn, resource, fence)
        tx = self._lookup(conn, job)
        job.effect_opened(tx.done)
        return tx

    def _close(self, tx: EffectTx, job: JobContext) -> None:
        if not tx.done:
            tx.conn.execute(
                jobs.insert().values(
                    job_key=job.record_key,
                    state="DONE",
                    fingerprint=job.fingerprint,
                    result=canonical_json(tx.result, what="the job result"),
                    fence=job.fence,
                    finished_at=time.time(),
                )
            )

    def _settle(
        self, job: JobContext, tx: EffectTx | None, lost: Exception, at_commit: bool
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
            return  # a replay: the stored result is known, the fence advance does not matter
        try:
            with self.engine.connect() as fresh:
                row = fresh.execute(
                    select(jobs.c.fingerprint, jobs.c.fence)
                    .where(jobs.c.job_key == job.record_key)
                ).first()
        except (OperationalError, InterfaceError) as again:
            raise CommitOutcomeUnknown(
                "the connection was lost at the effect's COMMIT and the database cannot be "
                "read", key=job.key, fence=job.fence,
                reason=f"{type(lost).__name__}, then {type(again).__name__}",
            ) from lost  # fmt: skip
        if row is not None and row.fence == job.fence and row.fingerprint == job.fingerprint:
            return  # it landed: the effect and its DONE row are in
        raise CommitOutcomeUnknown(
            "the connection was lost at the effect's COMMIT, which did not land",
            key=job.key, fence=job.fence, reason=type(lost).__name__,
        ) from lost  # fmt: skip

    def record(self, job_key: str) -> dict[str, Any] | None:
        ensure_tables(self.engine, TABLES)
        with self.engine.connect() as conn:
            row = conn.execute(select(jobs).where(jobs.c.job_key == job_key)).mappings().first()
        return dict(row) if row else None

    def _lookup(self, conn: Connection, job: JobContext) -> EffectTx:
        row = conn.execute(
            select(jobs.c.fingerprint, jobs.c.result).where(jobs.c.job_key == job.record_key)
        ).first()
        for key, fingerprint in job.previous if row is None else ():
            # During a key rotation: the job's DONE row written under a previous secret.
            old = conn.execute(
                select(jobs.c.fingerprint, jobs.c.result)
                .where(jobs.c.job_key == job.record_key_of(key))
            ).first()
            if old is not None and old.fingerprint == fingerprint:
                return EffectTx(conn, done=True, result=json.loads(old.result))
        if row is None:
            return EffectTx(conn, done=False)
        if row.fingerprint != job.fingerprint:
            raise IdempotencyConflict(
                "job key already used with different arguments", key=job.key, fence=job.fence
            )
        return EffectTx(conn, done=True, result=json.loads(row.result))


def _after_commit(session: Session, callback: Callable[[], None]) -> None:
    """Run `callback` once the Session's current root transaction commits; never on rollback
    (a later transaction of the same Session is another one, and does not count).

    One pair of listeners per Session, however many callbacks: a long-lived Session that
    publishes in transaction after transaction (a batch script) would otherwise gather a
    listener per call, each run at every later commit."""
    pending: list[tuple[Any, Callable[[], None]]] | None = session.info.get(_PENDING)
    if pending is None:
        pending = session.info[_PENDING] = []
        held = pending

        def after_commit(sess: Session) -> None:
            # after_commit fires for a released savepoint too: only a root's commit counts.
            if sess.in_nested_transaction():
                return
            root = sess.get_transaction()
            due = [cb for r, cb in held if r is root]
            held[:] = [(r, cb) for r, cb in held if r is not root]
            for cb in due:
                cb()

        def ended(_sess: Session, transaction: Any) -> None:
            if transaction.parent is None:  # a root ended (rolled back): its callbacks go
                held[:] = [(r, cb) for r, cb in held if r is not transaction]

        event.listen(session, "after_commit", after_commit)
        event.listen(session, "after_transaction_end", ended)
    pending.append((session.get_transaction(), callback))
