"""The PostgreSQL lock backend: a lease table on the server clock, fences in the common µs space."""

from __future__ import annotations

import fnmatch
import os
import random
import select
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, ClassVar

import psycopg
from psycopg import errors as pgerrors
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobfence.config.findings import Finding, LockTarget, refuse, warn
from jobfence.config.urls import redact
from jobfence.locks import registry
from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    LockBackend,
    LockInfo,
    poll_until_free,
)
from jobfence.locks.backends.postgres_semaphore import PostgresSemaphores
from jobfence.locks.backends.probe import foreign_sql_refusal
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import OwnerMeta

TABLE = "jobfence_locks"
FENCE_SEQUENCE = "jobfence_lock_fence_seq"
CHANNEL = "jobfence_release"
SCHEMES = registry.entry("postgres").schemes  # the registry is the one list
DEFAULT_PORT = 5432

# One row per (prefix, key): the lease, the job's final record, the queued-task marker and the
# crash-suspect delivery count. Rows outlive their lease (owner '' once released), so a key's
# last fence stays beside it and the next grant is above it; only the primary key is indexed,
# so every update stays HOT-able.
_DDL = [
    f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  prefix text NOT NULL,
  key text NOT NULL,
  owner text NOT NULL DEFAULT '',
  fence bigint NOT NULL DEFAULT 0,
  expires_at timestamptz NOT NULL DEFAULT '-infinity',
  task_id text NOT NULL DEFAULT '',
  host text NOT NULL DEFAULT '',
  pid integer NOT NULL DEFAULT 0,
  task_name text NOT NULL DEFAULT '',
  process_start text NOT NULL DEFAULT '',
  fingerprint text NOT NULL DEFAULT '',
  acquired_at timestamptz,
  heartbeat_at timestamptz,
  waiters boolean NOT NULL DEFAULT false,
  rec_state text,
  rec_fingerprint text,
  rec_result text,
  rec_fence bigint,
  rec_finished_at timestamptz,
  rec_expires_at timestamptz,
  queued_task text,
  queued_until timestamptz,
  deliveries integer NOT NULL DEFAULT 0,
  deliveries_until timestamptz,
  touched_at timestamptz NOT NULL DEFAULT clock_timestamp(),
  PRIMARY KEY (prefix, key)
) WITH (fillfactor = 70)""",
]

RATE_TABLE = "jobfence_rates"
# One row per rate limiter (locks/ratelimit.py): its GCRA state `tat` and the answer of the
# last step (RETURNING shows only the new row, so the step leaves its answer beside it).
# All in µs on the server clock.
_DDL.append(
    f"""CREATE TABLE IF NOT EXISTS {RATE_TABLE} (
  prefix text NOT NULL,
  key text NOT NULL,
  tat float8 NOT NULL,
  admitted boolean NOT NULL,
  wait_us float8 NOT NULL,
  now_us float8 NOT NULL,
  PRIMARY KEY (prefix, key)
)"""
)

# One GCRA step in one statement; the row lock of ON CONFLICT serialises racing steps, and
# each sees the tat the one before it committed (READ COMMITTED).
_RATE_START = "greatest(r.tat, excluded.now_us)"
_RATE_WAIT = f"greatest({_RATE_START} - %(tau)s - excluded.now_us, 0)"
_RATE_OK = f"(%(max_wait)s >= 0 AND {_RATE_WAIT} <= %(max_wait)s)"
_RATE_TAKE = f"""
INSERT INTO {RATE_TABLE} AS r (prefix, key, tat, admitted, wait_us, now_us)
SELECT %(prefix)s, %(key)s,
  CASE WHEN %(max_wait)s >= 0 THEN c.now_us + %(interval)s ELSE 0 END,
  %(max_wait)s >= 0, 0, c.now_us
FROM (SELECT extract(epoch FROM clock_timestamp())::float8 * 1000000 AS now_us) c
ON CONFLICT (prefix, key) DO UPDATE SET
  tat = CASE WHEN {_RATE_OK} THEN {_RATE_START} + %(interval)s ELSE r.tat END,
  admitted = {_RATE_OK},
  wait_us = {_RATE_WAIT},
  now_us = excluded.now_us
RETURNING admitted, wait_us, now_us
"""

# The fence source starts at the server clock in µs when it is created (the common fence
# space of DESIGN §4); CREATE SEQUENCE takes only literals, hence the DO block.
_CREATE_SEQUENCE = f"""DO $$ BEGIN
  EXECUTE format('CREATE SEQUENCE IF NOT EXISTS {FENCE_SEQUENCE} AS bigint START WITH %s',
                 (extract(epoch FROM clock_timestamp()) * 1000000)::bigint);
END $$"""

_NOW_US = "(extract(epoch FROM c.now) * 1000000)::bigint"

# Grant if the lease is free or expired, unless (job grants) a live DONE record answers.
# `excluded.touched_at` is the one clock reading of the statement, so every CASE agrees.
# (coalesce: a NULL record column must not turn the test into NULL, read as false.)
_DONE = (
    "coalesce(%(record)s AND l.rec_state = 'DONE' AND l.rec_expires_at > excluded.touched_at, "
    "false)"
)
_GRANT = f"(l.expires_at <= excluded.touched_at AND NOT {_DONE})"


def _take(column: str) -> str:
    return f"{column} = CASE WHEN {_GRANT} THEN excluded.{column} ELSE l.{column} END"


# One statement that always answers: granted, busy (holder's task id, fingerprint, TTL
# left) or DONE. The CASE form, never `DO UPDATE ... WHERE` plus a fallback SELECT: a
# loser racing on an absent key would read the statement's older snapshot and get nothing.
_BEGIN = f"""
INSERT INTO {TABLE} AS l (prefix, key, owner, fence, expires_at, task_id, host, pid, task_name,
  process_start, fingerprint, acquired_at, heartbeat_at, waiters, touched_at)
SELECT %(prefix)s, %(key)s, %(owner)s,
  greatest(nextval('{FENCE_SEQUENCE}'), {_NOW_US}, %(floor)s + 1),
  c.now + %(ttl)s * interval '1 millisecond', %(task_id)s, %(host)s, %(pid)s, %(task_name)s,
  %(process_start)s, %(fingerprint)s, c.now, c.now, false, c.now
FROM (SELECT clock_timestamp() AS now) c
ON CONFLICT (prefix, key) DO UPDATE SET
  {_take("owner")},
  fence = CASE WHEN {_GRANT} THEN greatest(excluded.fence, l.fence + 1) ELSE l.fence END,
  {_take("expires_at")}, {_take("task_id")}, {_take("host")}, {_take("pid")},
  {_take("task_name")}, {_take("process_start")}, {_take("fingerprint")},
  {_take("acquired_at")}, {_take("heartbeat_at")},
  waiters = CASE WHEN {_GRANT} THEN false WHEN {_DONE} THEN l.waiters ELSE true END,
  rec_state = CASE WHEN {_GRANT} AND %(record)s THEN NULL ELSE l.rec_state END,
  touched_at = excluded.touched_at
RETURNING owner = %(owner)s, fence,
  extract(epoch FROM greatest(expires_at, clock_timestamp()) - clock_timestamp())::float8,
  task_id, fingerprint,
  (%(record)s AND rec_state = 'DONE' AND rec_expires_at > touched_at),
  rec_fingerprint, rec_result, rec_fence, extract(epoch FROM rec_finished_at)::float8
"""

_EXTEND = f"""
UPDATE {TABLE} SET expires_at = clock_timestamp() + %s * interval '1 millisecond',
  heartbeat_at = clock_timestamp()
WHERE prefix = %s AND key = %s AND owner = %s AND expires_at > clock_timestamp()
"""

_EXTEND_MANY = f"""
UPDATE {TABLE} l SET expires_at = clock_timestamp() + v.ttl * interval '1 millisecond',
  heartbeat_at = clock_timestamp()
FROM unnest(%s::text[], %s::text[], %s::int[]) AS v(key, owner, ttl)
WHERE l.prefix = %s AND l.key = v.key AND l.owner = v.owner
  AND l.expires_at > clock_timestamp()
RETURNING l.key, l.owner
"""

# Release and commit leave `waiters` as it was, so RETURNING shows whether a refused
# attempt marked the lease: only then is a wake-up sent (NOTIFY serialises commits).
_FREE = "owner = '', expires_at = '-infinity', touched_at = clock_timestamp()"
_MINE = "prefix = %(prefix)s AND key = %(key)s AND owner = %(owner)s " \
    "AND expires_at > clock_timestamp()"
_WAKE = """, n AS (SELECT pg_notify(%(channel)s, %(payload)s) FROM r WHERE r.waiters)
SELECT (SELECT count(*) FROM r), (SELECT count(*) FROM n)"""

_RELEASE = f"WITH r AS (UPDATE {TABLE} SET {_FREE} WHERE {_MINE} RETURNING waiters){_WAKE}"

# The job record is flushed before the answer (synchronous_commit on for this statement's
# transaction), whatever the session's setting: the lease statements commit asynchronously.
_COMMIT = f"""WITH s AS (SELECT set_config('synchronous_commit', 'on', true) AS v),
r AS (UPDATE {TABLE} SET {_FREE}, rec_state = %(state)s,
  rec_fingerprint = %(fingerprint)s, rec_result = %(result)s, rec_fence = %(fence)s,
  rec_finished_at = clock_timestamp(),
  rec_expires_at = clock_timestamp() + %(result_ttl)s * interval '1 millisecond'
WHERE {_MINE} AND (SELECT v FROM s) = 'on' RETURNING waiters){_WAKE}"""

_FORCE_RELEASE = f"""WITH r AS (UPDATE {TABLE} SET {_FREE}
WHERE prefix = %(prefix)s AND key = %(key)s AND expires_at > clock_timestamp()
RETURNING true AS waiters){_WAKE}"""

_RELEASE_GRANT = f"""WITH r AS (UPDATE {TABLE} SET {_FREE}
WHERE prefix = %(prefix)s AND key = %(key)s AND fence = %(fence)s
  AND expires_at > clock_timestamp()
RETURNING true AS waiters){_WAKE}"""

_HOLDER = """fence, extract(epoch FROM expires_at - clock_timestamp())::float8, host, pid, task_id,
  task_name, extract(epoch FROM acquired_at)::float8,
  extract(epoch FROM coalesce(heartbeat_at, acquired_at))::float8, process_start"""

_INSPECT = f"""SELECT {_HOLDER} FROM {TABLE}
WHERE prefix = %s AND key = %s AND expires_at > clock_timestamp()"""

_SCAN = f"""SELECT key, {_HOLDER} FROM {TABLE}
WHERE prefix = %s AND key LIKE %s AND expires_at > clock_timestamp() ORDER BY key"""

_JOB_RECORD = f"""SELECT rec_state, rec_fingerprint, rec_result, rec_fence,
  extract(epoch FROM rec_finished_at)::float8 FROM {TABLE}
WHERE prefix = %s AND key = %s AND rec_state IN ('DONE', 'FAILED')
  AND rec_expires_at > clock_timestamp()"""

_FORGET = f"""UPDATE {TABLE} SET rec_state = NULL, rec_fingerprint = NULL, rec_result = NULL,
  rec_fence = NULL, rec_finished_at = NULL, rec_expires_at = NULL
WHERE prefix = %s AND key = %s AND rec_state IS NOT NULL AND rec_expires_at > clock_timestamp()"""

_CLAIM_PUBLISH = f"""
INSERT INTO {TABLE} AS l (prefix, key, queued_task, queued_until, touched_at)
SELECT %(prefix)s, %(key)s, %(task_id)s, c.now + %(ttl)s * interval '1 millisecond', c.now
FROM (SELECT clock_timestamp() AS now) c
ON CONFLICT (prefix, key) DO UPDATE SET
  queued_task = CASE WHEN l.queued_until > excluded.touched_at
    AND l.queued_task <> excluded.queued_task THEN l.queued_task ELSE excluded.queued_task END,
  queued_until = CASE WHEN l.queued_until > excluded.touched_at
    AND l.queued_task <> excluded.queued_task THEN l.queued_until ELSE excluded.queued_until END,
  touched_at = excluded.touched_at
RETURNING queued_task
"""

_CLEAR_PUBLISH = f"""UPDATE {TABLE} SET queued_task = NULL, queued_until = NULL
WHERE prefix = %s AND key = %s AND queued_task IS NOT NULL"""

# The claim changes unless a live value other than expect or new holds it; touched_at moves
# only with a change, so RETURNING can tell a change (new, until = touched + ttl) apart.
_KEPT = """l.queued_task IS NOT NULL AND l.queued_until > excluded.touched_at
    AND l.queued_task <> %(expect)s AND l.queued_task IS DISTINCT FROM %(new)s::text"""
_SWAP_PUBLISH = f"""
INSERT INTO {TABLE} AS l (prefix, key, queued_task, queued_until, touched_at)
SELECT %(prefix)s, %(key)s, %(new)s::text, CASE WHEN %(new)s::text IS NULL THEN NULL
  ELSE c.now + %(ttl)s * interval '1 millisecond' END, c.now
FROM (SELECT clock_timestamp() AS now) c
ON CONFLICT (prefix, key) DO UPDATE SET
  queued_task = CASE WHEN {_KEPT} THEN l.queued_task ELSE excluded.queued_task END,
  queued_until = CASE WHEN {_KEPT} THEN l.queued_until ELSE excluded.queued_until END,
  touched_at = CASE WHEN {_KEPT} THEN l.touched_at ELSE excluded.touched_at END
RETURNING CASE WHEN queued_task IS NOT DISTINCT FROM %(new)s::text
  AND queued_until IS NOT DISTINCT FROM CASE WHEN %(new)s::text IS NULL THEN NULL
    ELSE touched_at + %(ttl)s * interval '1 millisecond' END
  THEN NULL ELSE queued_task END
"""

_COUNT_DELIVERY = f"""
INSERT INTO {TABLE} AS l (prefix, key, deliveries, deliveries_until, touched_at)
SELECT %(prefix)s, %(key)s, 1, c.now + %(window)s * interval '1 millisecond', c.now
FROM (SELECT clock_timestamp() AS now) c
ON CONFLICT (prefix, key) DO UPDATE SET
  deliveries = CASE WHEN l.deliveries_until > excluded.touched_at THEN l.deliveries + 1
    ELSE 1 END,
  deliveries_until = excluded.deliveries_until, touched_at = excluded.touched_at
RETURNING deliveries
"""

# Housekeeping, at most once per interval across the fleet: the row (prefix, '') (no lock
# key is empty) holds the time of the last pass; whoever moves it forward prunes.
_PRUNE_TURN = f"""
INSERT INTO {TABLE} AS l (prefix, key, touched_at) VALUES (%s, '', clock_timestamp())
ON CONFLICT (prefix, key) DO UPDATE SET touched_at = excluded.touched_at
WHERE l.touched_at < excluded.touched_at - %s * interval '1 millisecond'
RETURNING 1"""

# Rows with nothing live left (lease, record, marker, count) and no grant or attempt for
# the fence retention: the next grant of such a key is above its last fence anyway (µs).
_PRUNE = f"""DELETE FROM {TABLE} WHERE prefix = %s AND key <> ''
  AND expires_at < clock_timestamp()
  AND touched_at < clock_timestamp() - %s * interval '1 millisecond'
  AND coalesce(rec_expires_at, '-infinity') < clock_timestamp()
  AND coalesce(queued_until, '-infinity') < clock_timestamp()
  AND coalesce(deliveries_until, '-infinity') < clock_timestamp()"""

# A limiter whose next turn passed a minute ago is idle: its row means what no row means.
_PRUNE_RATES = f"""DELETE FROM {RATE_TABLE} WHERE prefix = %s
  AND tat < extract(epoch FROM clock_timestamp())::float8 * 1000000 - 60000000"""

PRUNE_INTERVAL = 600.0

# A waiter marks the lease it waits for (so its release notifies) and learns whether it is
# still held, after LISTEN is in place: a release after this answer is never missed.
_MARK_WAITING = f"""UPDATE {TABLE} SET waiters = true
WHERE prefix = %s AND key = %s AND expires_at > clock_timestamp()"""

# Behind a transaction pooler a waiter polls this instead (LISTEN is session state).
_HELD = f"""SELECT 1 FROM {TABLE}
WHERE prefix = %s AND key = %s AND expires_at > clock_timestamp()"""
POLL_FIRST = 0.002  # the poll's first step, doubled up to POLL_CAP
POLL_CAP = 0.05

# Where the connection's own backend pid (its cancel key) is not the pid of the server
# session that runs its statements, a pooler sits between: PgBouncer, Odyssey, PgCat,
# Supavisor and RDS Proxy hand each client a cancel key of their own.
_SERVER_PID = "SELECT pg_backend_pid()"


def behind_pooler(conn: psycopg.Connection[Any]) -> bool:
    """Whether `conn` reaches PostgreSQL through a pooler (one round trip, at connect).

    Through a transaction pooler each transaction may run on another server session, so
    nothing may outlive one: no prepared statements (another client's `_pg3_0` is there, or
    ours is not), no LISTEN. A session pooler is taken for one too: that costs only speed.
    """
    row = conn.execute(_SERVER_PID, prepare=False).fetchone()
    return row is None or int(row[0]) != conn.info.backend_pid


def without_session_state(conn: psycopg.Connection[Any]) -> None:
    """No statement of `conn` is ever prepared (psycopg prepares after 5 runs, or at once
    with prepare=True): the state a transaction pooler would mix up between clients."""
    conn.prepare_threshold = None


# PgBouncer (and most poolers) refuse the startup `options` this backend sends unless told
# to ignore them; say so, with the fix, rather than a bare connection error.
_OPTIONS_REFUSED = "unsupported startup parameter"
OPTIONS_FIX = (
    "a pooler between jobfence and PostgreSQL refuses the startup options: add "
    "`ignore_startup_parameters = options` to pgbouncer.ini (and set the timeouts on the "
    "role: docs/how-to/pgbouncer.md#the-poolers-settings)"
)


def options_refused(exc: BaseException) -> bool:
    """Whether `exc` is a pooler refusing the startup options (see OPTIONS_FIX)."""
    return isinstance(exc, psycopg.OperationalError) and _OPTIONS_REFUSED in str(exc)


# Connections inherited through fork, set aside in the child and never closed there: a
# close() would send libpq's goodbye on the socket the parent still uses.
_inherited: list[Any] = []


# -- each statement's parameters and answer, shared by PostgresBackend and the asyncio store
# (locks/backends/postgres_async.py): one protocol, two connection kinds.
def begin_params(
    prefix: str, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool,
    fingerprint: str, floor: int,
) -> dict[str, Any]:  # fmt: skip
    return {
        "prefix": prefix, "key": key, "owner": owner, "floor": floor,
        "ttl": ttl_ms, "task_id": meta.task_id, "host": meta.host, "pid": meta.pid,
        "task_name": meta.task_name, "process_start": meta.process_start,
        "fingerprint": fingerprint if record else "", "record": record,
    }  # fmt: skip


def parse_begin(row: tuple[Any, ...]) -> int | Busy | JobRecord:
    """_BEGIN's row: the new fence, the job record if DONE, or Busy."""
    granted, fence, ttl_left, task_id, fp, done, rfp, result, rfence, finished = row
    if granted:
        return int(fence)
    if done:
        return JobRecord(
            state="DONE",
            fingerprint=rfp or "",
            result=result or "",
            fence=int(rfence or 0),
            finished_at=float(finished or 0),
        )
    return Busy(ttl_left=max(0.0, float(ttl_left)), task_id=task_id, fingerprint=fp)


def commit_params(rec: CommitRecord) -> dict[str, Any]:
    """_COMMIT's parameters but those of the wake (wake_params adds them)."""
    _, owner, fence, state, result, fingerprint, result_ttl_ms = rec
    return {"owner": owner, "state": state, "result": result, "fingerprint": fingerprint,
            "fence": fence, "result_ttl": result_ttl_ms}  # fmt: skip


def parse_job_record(rows: list[tuple[Any, ...]]) -> JobRecord | None:
    """_JOB_RECORD's rows: the job record, if DONE or FAILED and not expired."""
    if not rows:
        return None
    state, fp, result, fence, finished = rows[0]
    return JobRecord(
        state=state,
        fingerprint=fp or "",
        result=result or "",
        fence=int(fence or 0),
        finished_at=float(finished or 0),
    )


def extend_params(prefix: str, items: Sequence[tuple[str, str, int]]) -> tuple[Any, ...]:
    return ([k for k, _, _ in items], [o for _, o, _ in items], [t for _, _, t in items], prefix)


def parse_extend(items: Sequence[tuple[str, str, int]], rows: list[tuple[Any, ...]]) -> list[bool]:
    # By key and owner: a batch may name one key twice (a lost lease and the new one).
    ours = {(r[0], r[1]) for r in rows}
    return [(k, o) in ours for k, o, _ in items]


def wake_params(prefix: str, key: str, params: dict[str, Any]) -> dict[str, Any]:
    """A release's (or commit's) parameters, with the NOTIFY that wakes the key's waiters."""
    return {**params, "prefix": prefix, "key": key, "channel": CHANNEL,
            "payload": f"{prefix}\n{key}"}  # fmt: skip


def _like_prefix(match: str) -> str:
    """A LIKE pattern for the literal head of glob `match` (the glob itself is applied after)."""
    head = ""
    for ch in match:
        if ch in "*?[":
            break
        head += ch
    return head.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


class PostgresBackend(PostgresSemaphores, LockBackend):
    """Leases in one PostgreSQL table. Build with `from_url`; tables are made on first use."""

    name: ClassVar[str] = "postgres"
    fence_sequence: ClassVar[str] = FENCE_SEQUENCE
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=False, release_notify=True,
        semaphore=True, rate_limit=True,
    )

    def __init__(
        self,
        conninfo: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = 30 * 24 * 3600.0,
        prune_interval: float = PRUNE_INTERVAL,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(clock=clock)
        self.prefix = prefix
        self.fence_retention_ms = max(1, int(fence_retention * 1000))
        self.prune_interval = prune_interval
        # The first pass comes a while after start: short-lived processes (a CLI) leave it
        # to the fleet, and a fleet started at once does not open a connection each for it.
        self._next_prune = clock.monotonic() + prune_interval * random.uniform(0.5, 1.0)
        self.socket_timeout = socket_timeout
        self.conninfo = conninfo
        where = conninfo_to_dict(conninfo)  # never the password
        self._shown = f"{where.get('host', '')}:{where.get('port', '')}/{where.get('dbname', '')}"
        self.fence_floor = 0
        self.statements = 0  # statements sent (one round trip each), for tests and benchmarks
        self._pid = os.getpid()
        self._idle: list[psycopg.Connection[Any]] = []
        self._ready = False
        self._max_block = max(0.01, 0.8 * socket_timeout)
        # Whether the server is reached through a pooler: learned at each connect (the same
        # URL always reaches it the same way); then no prepared statements and no LISTEN.
        self.pooled: bool | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = 30 * 24 * 3600.0,
        prune_interval: float = PRUNE_INTERVAL,
        clock: Clock = SYSTEM_CLOCK,
    ) -> PostgresBackend:
        """`postgresql://`, `postgres://` or `postgresql+psycopg://` (libpq query options kept).

        A key's row (and its last fence) is pruned `fence_retention` seconds after its last
        use, once nothing in it is live; a later grant's fence is above it anyway (µs clock).
        """
        scheme, rest = url.split("://", 1)
        if scheme.lower() not in SCHEMES:
            raise ValueError(f"not a PostgreSQL URL: {scheme}://")
        base = "postgresql://" + rest
        ms = max(1, int(socket_timeout * 1000))
        params = conninfo_to_dict(base)
        # Server-side bounds (a stuck statement ends within socket_timeout); READ COMMITTED
        # whatever the server's default: the upserts wait for a racing writer and then see
        # its row, where REPEATABLE READ would fail them. Lease statements commit without
        # waiting for the WAL flush (half the latency): a crash may forget the last grants,
        # whose holders then lose the lease at their next heartbeat, and the next grant's
        # fence is still above theirs (server µs clock). Job records are flushed (_COMMIT).
        # Keepalives and tcp_user_timeout make a silent network fail the call instead of
        # hanging it for hours.
        options = str(params.get("options", "") or "")
        options += (
            f" -c statement_timeout={ms} -c lock_timeout={ms}"
            " -c synchronous_commit=off -c default_transaction_isolation=read\\ committed"
            " -c idle_in_transaction_session_timeout=" + str(max(ms, 10000))
        )
        conninfo = make_conninfo(
            base,
            connect_timeout=max(1, int(socket_timeout + 0.999)),
            tcp_user_timeout=ms,
            keepalives=1,
            keepalives_idle=max(1, int(socket_timeout)),
            keepalives_interval=1,
            keepalives_count=2,
            application_name=str(params.get("application_name") or "jobfence"),
            options=options.strip(),
        )
        return cls(
            conninfo,
            prefix=prefix,
            socket_timeout=socket_timeout,
            fence_retention=fence_retention,
            prune_interval=prune_interval,
            clock=clock,
        )

    # -- connections -------------------------------------------------------------
    def _connect(self) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(self.conninfo, autocommit=True)
        except psycopg.OperationalError as exc:
            if options_refused(exc):
                raise psycopg.OperationalError(f"{OPTIONS_FIX}: {exc}") from exc
            raise
        try:
            self.pooled = behind_pooler(conn)
        except BaseException:
            conn.close()
            raise
        if self.pooled:
            without_session_state(conn)
        return conn

    def _forked(self) -> None:
        if self._pid != os.getpid():
            _inherited.extend(self._idle)
            self._pid, self._idle = os.getpid(), []

    @contextmanager
    def _conn(self, what: str, key: str | None) -> Iterator[psycopg.Connection[Any]]:
        """A connection of this process for one statement; errors become BackendUnavailable."""
        self._forked()
        conn: psycopg.Connection[Any] | None = None
        try:
            conn = self._idle.pop()  # atomic: no two threads get the same one
        except IndexError:
            pass
        else:
            # Readable while idle: the server closed it (restart, idle timeout). Drop it now
            # rather than fail a statement the server never saw.
            try:
                stale = conn.closed or bool(select.select([conn.fileno()], [], [], 0)[0])
            except (OSError, ValueError, psycopg.Error):
                stale = True
            if stale:
                conn.close()
                conn = None
        try:
            if conn is None:
                conn = self._connect()
            yield conn
        except psycopg.Error as exc:
            if conn is not None and conn.broken:
                conn.close()
            raise BackendUnavailable(
                f"postgres {what} failed on {self._shown}", key=key, cause=exc
            ) from exc
        finally:
            if conn is not None and not conn.closed:
                self._idle.append(conn)

    def _run(self, what: str, key: str | None, sql: str, params: Any) -> list[tuple[Any, ...]]:
        """One statement, one round trip; creates the tables the first time they are missing."""
        for attempt in (0, 1):
            try:
                if not self._ready:
                    self.create_tables()
                with self._conn(what, key) as conn:
                    self.statements += 1
                    cur = conn.execute(sql, params, prepare=True)
                    return cur.fetchall() if cur.description else [(cur.rowcount,)]
            except BackendUnavailable as exc:
                # The tables vanished (a restore without them): make them and run it again;
                # the statement failed whole, so nothing ran twice.
                if attempt == 0 and isinstance(exc.cause, pgerrors.UndefinedTable):
                    self._ready = False
                    continue
                raise
        raise AssertionError("unreachable")

    def create_tables(self) -> None:
        """Create the lease table and the fence sequence where missing (safe to repeat)."""
        with self._conn("create tables", None) as conn, conn.transaction():
            # Serialise creators: two CREATE ... IF NOT EXISTS at once can still collide.
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (TABLE,))
            conn.execute(_CREATE_SEQUENCE)
            for stmt in _DDL:
                conn.execute(stmt)
        self._ready = True

    def server_time(self) -> float:
        """Now on the server's clock (`clock_timestamp()`: the clock expiry runs on)."""
        rows = self._run(
            "server time", None, "SELECT extract(epoch FROM clock_timestamp())::float8", None
        )
        return float(rows[0][0])

    def _ping(self) -> str:
        # Not through _run: a probe must not create the tables on first use.
        with self._conn("health", None) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return f"PostgreSQL {row[0] if row else '?'}"

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        """Reachable, and its sessions as its statements need them (`session_problems`)."""
        setting, url = target.setting, target.url
        try:
            problems = self.session_problems()
        except BackendUnavailable as exc:
            if OPTIONS_FIX in str(exc.cause):  # a pooler that refuses them for good: no outage
                yield refuse(
                    setting,
                    f"the lock database at {redact(url)}: {OPTIONS_FIX}",
                    "add `ignore_startup_parameters = options` to pgbouncer.ini",
                )
                return
            foreign = foreign_sql_refusal(target, "PostgreSQL", DEFAULT_PORT)
            if foreign is not None:
                yield foreign
                return
            # As for Redis: come up and wait rather than crash-loop during an outage.
            yield warn(
                setting,
                f"cannot reach the lock database at {redact(url)} at start-up ({exc.cause}); "
                "starting anyway: jobs wait and are redelivered until it answers",
                "start the database, or fix the URL if it is wrong",
            )
            return
        for problem in problems:
            yield refuse(
                setting,
                f"the lock database at {redact(url)}: {problem}",
                "use PostgreSQL 11 or later; behind a pooler that drops the startup options, "
                "ALTER ROLE ... SET default_transaction_isolation = 'read committed'",
            )

    def session_problems(self) -> list[str]:
        """What in this server or session breaks the backend's statements (start-up check).

        A pooler that drops the startup options (PgBouncer's ignore_startup_parameters)
        leaves the server's default isolation in place, under which racing acquires fail.
        """
        rows = self._run(
            "session check",
            None,
            "SELECT current_setting('server_version_num')::int, "
            "current_setting('transaction_isolation')",
            None,
        )
        version, isolation = rows[0]
        problems = []
        if version < 110000:
            problems.append(f"PostgreSQL {version // 10000} is too old (11 or later needed)")
        if isolation != "read committed":
            problems.append(
                f"sessions run at isolation {isolation!r}, not 'read committed' (a pooler "
                "dropped the startup options?), so racing acquires fail instead of waiting"
            )
        return problems

    def prune(self) -> int | None:
        """Delete rows unused for the fence retention; None if another pass ran lately."""
        if not self._ready:
            self.create_tables()
        with self._conn("prune", None) as conn, conn.transaction():
            interval_ms = max(1, int(self.prune_interval * 1000))
            if conn.execute(_PRUNE_TURN, (self.prefix, interval_ms)).fetchone() is None:
                return None
            conn.execute("SET LOCAL statement_timeout = '60s'")
            pruned = conn.execute(_PRUNE, (self.prefix, self.fence_retention_ms)).rowcount
            return pruned + conn.execute(_PRUNE_RATES, (self.prefix,)).rowcount

    def _prune_soon(self) -> None:
        """Prune in a daemon thread, off the caller's path; errors wait for the next turn."""
        self._next_prune = self.clock.monotonic() + self.prune_interval

        def run() -> None:
            with suppress(BackendUnavailable):
                self.prune()

        threading.Thread(target=run, name="jobfence-pg-prune", daemon=True).start()

    @staticmethod
    def ddl() -> list[str]:
        """The statements `create_tables` runs, for a DBA."""
        return [_CREATE_SEQUENCE, *_DDL]

    # -- one round trip each ----------------------------------------------------
    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        params = begin_params(self.prefix, key, owner, ttl_ms, meta, record, fingerprint,
                              self.fence_floor)  # fmt: skip
        got = parse_begin(self._run("begin", key, _BEGIN, params)[0])
        if self.clock.monotonic() >= self._next_prune:
            self._prune_soon()
        if isinstance(got, int) and got > self.fence_floor:
            self.fence_floor = got
        return got

    def _take_rate(
        self, key: str, interval_us: float, burst: int, max_wait_us: float
    ) -> tuple[bool, float, float]:
        params = {
            "prefix": self.prefix, "key": key, "interval": interval_us,
            "tau": (burst - 1) * interval_us, "max_wait": min(max_wait_us, 1e300),
        }  # fmt: skip
        admitted, wait_us, now_us = self._run("rate take", key, _RATE_TAKE, params)[0]
        return bool(admitted), float(wait_us), float(now_us)

    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        rows = self._run("extend", key, _EXTEND, (ttl_ms, self.prefix, key, owner))
        return bool(rows[0][0])

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        rows = self._run("extend_many", None, _EXTEND_MANY, extend_params(self.prefix, items))
        return parse_extend(items, rows)

    def _wake(self, what: str, key: str, sql: str, params: dict[str, Any]) -> bool:
        return bool(self._run(what, key, sql, wake_params(self.prefix, key, params))[0][0])

    def _release(self, key: str, owner: str) -> bool:
        return self._wake("release", key, _RELEASE, {"owner": owner})

    def _commit(self, rec: CommitRecord) -> bool:
        return self._wake("commit", rec.key, _COMMIT, commit_params(rec))

    def _inspect(self, key: str) -> LockInfo | None:
        rows = self._run("inspect", key, _INSPECT, (self.prefix, key))
        return self._info(key, rows[0]) if rows else None

    @staticmethod
    def _info(key: str, row: tuple[Any, ...]) -> LockInfo:
        fence, ttl_left, host, pid, task_id, task_name, acquired, heartbeat, started = row
        return LockInfo(
            key=key,
            fence=int(fence),
            ttl_left=max(0.0, float(ttl_left)),
            host=host,
            pid=int(pid),
            task_id=task_id,
            task_name=task_name,
            acquired_at=float(acquired or 0),
            last_heartbeat=float(heartbeat or 0),
            process_start=started,
        )

    # -- admin and waiting --------------------------------------------------------
    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        rows = self._run("scan", None, _SCAN, (self.prefix, _like_prefix(match)))
        for key, *rest in rows:
            if fnmatch.fnmatchcase(key, match):
                yield self._info(key, tuple(rest))

    def job_record(self, key: str) -> JobRecord | None:
        return parse_job_record(self._run("job_record", key, _JOB_RECORD, (self.prefix, key)))

    def forget(self, key: str) -> bool:
        return bool(self._run("forget", key, _FORGET, (self.prefix, key))[0][0])

    def force_release(self, key: str) -> bool:
        return self._wake("force_release", key, _FORCE_RELEASE, {})

    def release_grant(self, key: str, fence: int) -> bool:
        """Remove `key`'s lock if still held under `fence`: checked in the one statement."""
        return self._wake("release_grant", key, _RELEASE_GRANT, {"fence": fence})

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        params = {"prefix": self.prefix, "key": key, "task_id": task_id,
                  "ttl": max(1, int(ttl * 1000))}  # fmt: skip
        held = self._run("claim_publish", key, _CLAIM_PUBLISH, params)[0][0]
        return held if held and held != task_id else None

    def clear_publish(self, key: str) -> None:
        self._run("clear_publish", key, _CLEAR_PUBLISH, (self.prefix, key))

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        params = {"prefix": self.prefix, "key": key, "expect": expect, "new": new,
                  "ttl": ttl_ms}  # fmt: skip
        kept: str | None = self._run("swap_publish", key, _SWAP_PUBLISH, params)[0][0]
        return kept

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        params = {"prefix": self.prefix, "key": key, "window": window_ms}
        return int(self._run("count_delivery", key, _COUNT_DELIVERY, params)[0][0])

    def wait_for_release(self, key: str, timeout: float) -> None:
        """Block until `key` is released (LISTEN/NOTIFY) or `timeout` passes.

        The waiting connection listens only while it waits (LISTEN, mark the lease as
        waited on and see it still held, wait, UNLISTEN), so a process needs no second
        connection, and a release after the mark is never missed. Behind a pooler (see
        `behind_pooler`) it polls the lease instead: LISTEN is session state.
        """
        timeout = min(timeout, self._max_block)
        if timeout < 0.001:
            return
        if not self._ready:
            self.create_tables()
        if self.pooled:
            self._poll_for_release(key, timeout)
            return
        payload = f"{self.prefix}\n{key}"
        with self._conn("wait", key) as conn:
            conn.execute(f"LISTEN {CHANNEL}")
            try:
                self.statements += 2
                if conn.execute(_MARK_WAITING, (self.prefix, key), prepare=True).rowcount:
                    for note in conn.notifies(timeout=timeout):
                        if note.payload == payload:
                            break
            finally:
                conn.execute(f"UNLISTEN {CHANNEL}")
                self.statements += 1

    def _poll_for_release(self, key: str, timeout: float) -> None:
        """Behind a pooler: read the lease with doubling, jittered steps until it is free or
        `timeout` passes (a LISTEN would stay on whichever server session ran it)."""
        poll_until_free(
            self.clock, timeout, lambda: bool(self._run("wait", key, _HELD, (self.prefix, key))),
            POLL_FIRST, POLL_CAP,
        )  # fmt: skip

    def close(self) -> None:
        if self._pid != os.getpid():
            self._forked()
            return
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
