"""The PostgreSQL backend's SQL: its tables, their DDL and each call's statement, as constants.

Every statement is one round trip on the server clock (`clock_timestamp()`), shared by the sync
store (backend.py) and the asyncio one (async_store.py); protocol.py holds their parameters and
answers.
"""

from __future__ import annotations

TABLE = "jobfence_locks"
RATE_TABLE = "jobfence_rates"
FENCE_SEQUENCE = "jobfence_lock_fence_seq"
CHANNEL = "jobfence_release"

# One row per (prefix, key): the lease, the job's final record, the queued-task marker and the
# crash-suspect delivery count. Rows outlive their lease (owner '' once released), so a key's
# last fence stays beside it and the next grant is above it; only the primary key is indexed,
# so every update stays HOT-able.
_LEASES_DDL = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
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
) WITH (fillfactor = 70)"""

# One row per rate limiter (locks/ratelimit.py): its GCRA state `tat` and the answer of the
# last step (RETURNING shows only the new row, so the step leaves its answer beside it).
# All in µs on the server clock.
_RATES_DDL = f"""CREATE TABLE IF NOT EXISTS {RATE_TABLE} (
  prefix text NOT NULL,
  key text NOT NULL,
  tat float8 NOT NULL,
  admitted boolean NOT NULL,
  wait_us float8 NOT NULL,
  now_us float8 NOT NULL,
  PRIMARY KEY (prefix, key)
)"""

DDL = [_LEASES_DDL, _RATES_DDL]

# One GCRA step in one statement; the row lock of ON CONFLICT serialises racing steps, and
# each sees the tat the one before it committed (READ COMMITTED).
_RATE_START = "greatest(r.tat, excluded.now_us)"
_RATE_WAIT = f"greatest({_RATE_START} - %(tau)s - excluded.now_us, 0)"
_RATE_OK = f"(%(max_wait)s >= 0 AND {_RATE_WAIT} <= %(max_wait)s)"
RATE_TAKE = f"""
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
CREATE_SEQUENCE = f"""DO $$ BEGIN
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
BEGIN = f"""
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

EXTEND = f"""
UPDATE {TABLE} SET expires_at = clock_timestamp() + %s * interval '1 millisecond',
  heartbeat_at = clock_timestamp()
WHERE prefix = %s AND key = %s AND owner = %s AND expires_at > clock_timestamp()
"""

EXTEND_MANY = f"""
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

RELEASE = f"WITH r AS (UPDATE {TABLE} SET {_FREE} WHERE {_MINE} RETURNING waiters){_WAKE}"

# The job record is flushed before the answer (synchronous_commit on for this statement's
# transaction), whatever the session's setting: the lease statements commit asynchronously.
COMMIT = f"""WITH s AS (SELECT set_config('synchronous_commit', 'on', true) AS v),
r AS (UPDATE {TABLE} SET {_FREE}, rec_state = %(state)s,
  rec_fingerprint = %(fingerprint)s, rec_result = %(result)s, rec_fence = %(fence)s,
  rec_finished_at = clock_timestamp(),
  rec_expires_at = clock_timestamp() + %(result_ttl)s * interval '1 millisecond'
WHERE {_MINE} AND (SELECT v FROM s) = 'on' RETURNING waiters){_WAKE}"""

FORCE_RELEASE = f"""WITH r AS (UPDATE {TABLE} SET {_FREE}
WHERE prefix = %(prefix)s AND key = %(key)s AND expires_at > clock_timestamp()
RETURNING true AS waiters){_WAKE}"""

RELEASE_GRANT = f"""WITH r AS (UPDATE {TABLE} SET {_FREE}
WHERE prefix = %(prefix)s AND key = %(key)s AND fence = %(fence)s
  AND expires_at > clock_timestamp()
RETURNING true AS waiters){_WAKE}"""

_HOLDER = """fence, extract(epoch FROM expires_at - clock_timestamp())::float8, host, pid, task_id,
  task_name, extract(epoch FROM acquired_at)::float8,
  extract(epoch FROM coalesce(heartbeat_at, acquired_at))::float8, process_start"""

INSPECT = f"""SELECT {_HOLDER} FROM {TABLE}
WHERE prefix = %s AND key = %s AND expires_at > clock_timestamp()"""

SCAN = f"""SELECT key, {_HOLDER} FROM {TABLE}
WHERE prefix = %s AND key LIKE %s AND expires_at > clock_timestamp() ORDER BY key"""

JOB_RECORD = f"""SELECT rec_state, rec_fingerprint, rec_result, rec_fence,
  extract(epoch FROM rec_finished_at)::float8 FROM {TABLE}
WHERE prefix = %s AND key = %s AND rec_state IN ('DONE', 'FAILED')
  AND rec_expires_at > clock_timestamp()"""

FORGET = f"""UPDATE {TABLE} SET rec_state = NULL, rec_fingerprint = NULL, rec_result = NULL,
  rec_fence = NULL, rec_finished_at = NULL, rec_expires_at = NULL
WHERE prefix = %s AND key = %s AND rec_state IS NOT NULL AND rec_expires_at > clock_timestamp()"""

CLAIM_PUBLISH = f"""
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

CLEAR_PUBLISH = f"""UPDATE {TABLE} SET queued_task = NULL, queued_until = NULL
WHERE prefix = %s AND key = %s AND queued_task IS NOT NULL"""

# The claim changes unless a live value other than expect or new holds it; touched_at moves
# only with a change, so RETURNING can tell a change (new, until = touched + ttl) apart.
_KEPT = """l.queued_task IS NOT NULL AND l.queued_until > excluded.touched_at
    AND l.queued_task <> %(expect)s AND l.queued_task IS DISTINCT FROM %(new)s::text"""
SWAP_PUBLISH = f"""
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

COUNT_DELIVERY = f"""
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
PRUNE_TURN = f"""
INSERT INTO {TABLE} AS l (prefix, key, touched_at) VALUES (%s, '', clock_timestamp())
ON CONFLICT (prefix, key) DO UPDATE SET touched_at = excluded.touched_at
WHERE l.touched_at < excluded.touched_at - %s * interval '1 millisecond'
RETURNING 1"""

# Rows with nothing live left (lease, record, marker, count) and no grant or attempt for
# the fence retention: the next grant of such a key is above its last fence anyway (µs).
PRUNE = f"""DELETE FROM {TABLE} WHERE prefix = %s AND key <> ''
  AND expires_at < clock_timestamp()
  AND touched_at < clock_timestamp() - %s * interval '1 millisecond'
  AND coalesce(rec_expires_at, '-infinity') < clock_timestamp()
  AND coalesce(queued_until, '-infinity') < clock_timestamp()
  AND coalesce(deliveries_until, '-infinity') < clock_timestamp()"""

# A limiter whose next turn passed a minute ago is idle: its row means what no row means.
PRUNE_RATES = f"""DELETE FROM {RATE_TABLE} WHERE prefix = %s
  AND tat < extract(epoch FROM clock_timestamp())::float8 * 1000000 - 60000000"""

# A waiter marks the lease it waits for (so its release notifies) and learns whether it is
# still held, after LISTEN is in place: a release after this answer is never missed.
MARK_WAITING = f"""UPDATE {TABLE} SET waiters = true
WHERE prefix = %s AND key = %s AND expires_at > clock_timestamp()"""

# Behind a transaction pooler a waiter polls this instead (LISTEN is session state).
HELD = f"""SELECT 1 FROM {TABLE}
WHERE prefix = %s AND key = %s AND expires_at > clock_timestamp()"""
