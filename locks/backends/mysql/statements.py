"""Each MySQL/MariaDB lock call's SQL: a table of templates the quoted table names are filled into.

One SQL text for both servers (tests/test_mysql_backend.py checks every statement sent): no
RETURNING (MariaDB only; answers come from a SELECT in the same transaction), no VALUES(col)
in upserts (deprecated on MySQL 8.0.20+) and no row alias (`AS new`, a syntax error on
MariaDB). A call needing several statements sends them as one multi-statement transaction.
Fields: {locks}, {jobs}, {fence}, {marks} (tables.lock_tables) and {rates}.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jobfence.locks.backends.mysql.tables import NOW_US, key_hash

_FREE = "expires_at <= NOW(6)"
_LIVE = "expires_at > NOW(6)"


def _take(col: str, value: str) -> str:
    return f"{col} = IF({_FREE}, {value}, {col})"


# The upsert names its new values as parameters again in the UPDATE part instead of
# VALUES(col) (deprecated on MySQL 8.0.20+) or a row alias (`AS new`, rejected by
# MariaDB): both servers accept this form without a warning. MySQL assigns left to
# right with the values already updated, so expires_at, which the guard reads,
# comes last.
_UPSERT = (
    "INSERT INTO {locks} (key_hash, lock_key, owner, fence, expires_at, acquired_at,"
    " heartbeat_at, task_id, task_name, host, pid, process_start, fingerprint)"
    " VALUES (%(h)s, %(k)s, %(o)s, 0, NOW(6) + INTERVAL %(ttl)s MICROSECOND, NOW(6),"
    " NOW(6), %(tid)s, %(tn)s, %(host)s, %(pid)s, %(ps)s, %(fp)s)"
    " ON DUPLICATE KEY UPDATE "
    + ", ".join(
        [
            _take("lock_key", "%(k)s"),
            _take("owner", "%(o)s"),
            _take("fence", "0"),
            _take("acquired_at", "NOW(6)"),
            _take("heartbeat_at", "NOW(6)"),
            _take("task_id", "%(tid)s"),
            _take("task_name", "%(tn)s"),
            _take("host", "%(host)s"),
            _take("pid", "%(pid)s"),
            _take("process_start", "%(ps)s"),
            _take("fingerprint", "%(fp)s"),
            _take("expires_at", "NOW(6) + INTERVAL %(ttl)s MICROSECOND"),
        ]
    )
)
_MINE = "SELECT 1 FROM {locks} WHERE key_hash = %(h)s AND owner = %(o)s"
_DONE = "SELECT 1 FROM {jobs} WHERE key_hash = %(h)s AND state = 'DONE' AND expires_at > NOW(6)"
# The DONE check runs after the upsert locked the lock row: a commit that finished
# before it is seen, and one still running holds the row, so ours waited for it.
_UNDO_IF_DONE = (
    f"DELETE FROM {{locks}} WHERE key_hash = %(h)s AND owner = %(o)s AND EXISTS ({_DONE})"
)
# Fences: the counter's next value, at least the server's clock in µs (the one
# fence space of every backend; it also keeps a database restored from a backup
# above the fences it issued since) and above this client's floor.
_ADVANCE = (
    f"UPDATE {{fence}} SET v = LAST_INSERT_ID(GREATEST(v + 1, %(floor)s + 1, {NOW_US}))"
    f" WHERE id = 1 AND EXISTS ({_MINE})"
)
_STAMP = "UPDATE {locks} SET fence = LAST_INSERT_ID() WHERE key_hash = %(h)s AND owner = %(o)s"
_CLEAR_FAILED = f"DELETE FROM {{jobs}} WHERE key_hash = %(h)s AND EXISTS ({_MINE})"
_ANSWER = (
    "SELECT owner = %(o)s, fence, TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at),"
    " task_id, fingerprint FROM {locks} WHERE key_hash = %(h)s"
)
_RECORD = (
    "SELECT state, fingerprint, result, fence,"
    " TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', finished_at)"
    " FROM {jobs} WHERE key_hash = %(h)s AND state = 'DONE' AND expires_at > NOW(6)"
)

# One GCRA step: the upsert locks the row, assigns left to right (each column sees those
# updated before it) and leaves its answer in the row for the SELECT.
_RATE_START = "GREATEST(tat, now_us)"
_RATE_TAKE = [
    "START TRANSACTION",
    "INSERT INTO {rates} (key_hash, tat, admitted, wait_us, now_us) VALUES (%(h)s,"
    f" IF(%(mw)s >= 0, {NOW_US} + %(iv)s, 0), %(mw)s >= 0, 0, {NOW_US})"
    f" ON DUPLICATE KEY UPDATE now_us = {NOW_US},"
    f" wait_us = GREATEST({_RATE_START} - %(tau)s - now_us, 0),"
    " admitted = (%(mw)s >= 0 AND wait_us <= %(mw)s),"
    f" tat = IF(admitted, {_RATE_START} + %(iv)s, tat)",
    "SELECT admitted, wait_us, now_us FROM {rates} WHERE key_hash = %(h)s",
    "COMMIT",
]


def _transaction(*statements: str) -> str:
    return ";".join(["START TRANSACTION", *statements, "COMMIT"])


# Where an acquire+release pair's ~1.2-1.5 ms goes on loopback here (MariaDB 10.11,
# profiled): two durable commits (a redo-log flush each, ~170 µs on this disk), the six
# statements of `begin` run server-side, and PyMySQL decoding seven replies (~400 µs
# of client CPU). One round trip per call is the floor. Reading a grant from the
# counter UPDATE's OK packet instead of a SELECT saved ~50 µs of client CPU, no wall
# time we could measure, and cost refused acquires a second round trip: not taken.
STATEMENTS: dict[str, str] = {
    "rate_take": ";".join(_RATE_TAKE),
    "begin": _transaction(_UPSERT, _ADVANCE, _STAMP, _ANSWER),
    "begin_job": _transaction(
        _UPSERT, _UNDO_IF_DONE, _ADVANCE, _STAMP, _CLEAR_FAILED, _ANSWER, _RECORD
    ),
    "extend": (
        "UPDATE {locks} SET heartbeat_at = NOW(6), expires_at = NOW(6) + INTERVAL %s"
        f" MICROSECOND WHERE key_hash = %s AND owner = %s AND {_LIVE}"
    ),
    "release": f"DELETE FROM {{locks}} WHERE key_hash = %s AND owner = %s AND {_LIVE}",
    "commit": _transaction(
        f"DELETE FROM {{locks}} WHERE key_hash = %(h)s AND owner = %(o)s AND {_LIVE}",
        "SET @jf_ok = ROW_COUNT()",
        "INSERT INTO {jobs} (key_hash, lock_key, state, fingerprint, result, fence,"
        " finished_at, expires_at) SELECT %(h)s, %(k)s, %(st)s, %(fp)s, %(res)s,"
        " %(fence)s, NOW(6), NOW(6) + INTERVAL %(rttl)s MICROSECOND FROM DUAL"
        " WHERE @jf_ok = 1 ON DUPLICATE KEY UPDATE lock_key = %(k)s,"
        " state = %(st)s, fingerprint = %(fp)s, result = %(res)s, fence = %(fence)s,"
        " finished_at = NOW(6), expires_at = NOW(6) + INTERVAL %(rttl)s MICROSECOND",
    )
    + ";SELECT @jf_ok",
    "inspect": (
        "SELECT fence, TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at), host, pid,"
        " task_id, task_name,"
        " TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', acquired_at),"
        " TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', heartbeat_at),"
        " process_start, lock_key FROM {locks}"
    ),
    "held": f"SELECT 1 FROM {{locks}} WHERE key_hash = %s AND {_LIVE}",
    "job_record": (
        "SELECT state, fingerprint, result, fence,"
        " TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', finished_at)"
        f" FROM {{jobs}} WHERE key_hash = %s AND state IN ('DONE', 'FAILED') AND {_LIVE}"
    ),
    "forget": f"DELETE FROM {{jobs}} WHERE key_hash = %s AND {_LIVE}",
    "force_release": f"DELETE FROM {{locks}} WHERE key_hash = %s AND {_LIVE}",
    "release_grant": f"DELETE FROM {{locks}} WHERE key_hash = %s AND fence = %s AND {_LIVE}",
    # A live marker of another task id stays; the value is assigned before
    # expires_at, so both read the old expiry.
    "claim_publish": _transaction(
        "INSERT INTO {marks} (key_hash, kind, value, n, expires_at) VALUES (%(h)s,"
        " 'q', %(v)s, 0, NOW(6) + INTERVAL %(ttl)s MICROSECOND)"
        " ON DUPLICATE KEY UPDATE"
        " value = IF(expires_at <= NOW(6) OR value = %(v)s, %(v)s, value),"
        " expires_at = IF(value = %(v)s, NOW(6) + INTERVAL %(ttl)s MICROSECOND,"
        " expires_at)",
        "SELECT value FROM {marks} WHERE key_hash = %(h)s AND kind = 'q'",
    ),
    "clear_publish": "DELETE FROM {marks} WHERE key_hash = %s AND kind = 'q'",
    # n (unused by claims) first records whether a live other value keeps the claim:
    # the later assignments read it. A removed claim is '' expiring now.
    "swap_publish": _transaction(
        "INSERT INTO {marks} (key_hash, kind, value, n, expires_at) VALUES (%(h)s,"
        " 'q', %(v)s, 0, NOW(6) + INTERVAL %(ttl)s MICROSECOND)"
        " ON DUPLICATE KEY UPDATE"
        " n = IF(expires_at > NOW(6) AND value <> %(e)s AND value <> %(v)s, 1, 0),"
        " value = IF(n = 1, value, %(v)s),"
        " expires_at = IF(n = 1, expires_at, NOW(6) + INTERVAL %(ttl)s MICROSECOND)",
        "SELECT IF(n = 1, value, NULL) FROM {marks} WHERE key_hash = %(h)s AND kind = 'q'",
    ),
    "count_delivery": _transaction(
        "INSERT INTO {marks} (key_hash, kind, value, n, expires_at) VALUES (%(h)s,"
        " 'd', '', 1, NOW(6) + INTERVAL %(ttl)s MICROSECOND)"
        " ON DUPLICATE KEY UPDATE n = IF(expires_at > NOW(6), n + 1, 1),"
        " expires_at = NOW(6) + INTERVAL %(ttl)s MICROSECOND",
        "SELECT n FROM {marks} WHERE key_hash = %(h)s AND kind = 'd'",
    ),
}


def statements(tables: dict[str, str], rates: str) -> dict[str, str]:
    """STATEMENTS with the quoted names of the lock `tables` and the `rates` table filled in."""
    return {name: sql.format(**tables, rates=rates) for name, sql in STATEMENTS.items()}


def extend_many(
    run: Callable[[str, Any, str | None], Any],
    table: str,
    items: Sequence[tuple[str, str, int]],
    *,
    by_key: bool = False,
) -> list[bool]:
    """Extend the leases `items` ((key, owner, ttl ms)) held in `table` (the locks', or a
    semaphore's slots) in one round trip of `run`; whether each is still held. `by_key`:
    the WHERE names the key hashes alone too (the locks table's primary key).

    One stamp for the batch: the rows extended now carry it, so the SELECT after the
    UPDATE (same round trip) names exactly them. Owner tokens are unique per lease."""
    hashes = [key_hash(k) for k, _, _ in items]
    pairs = ", ".join(["(%s, %s)"] * len(items))
    case = " ".join(["WHEN %s THEN %s"] * len(items))
    keyed = f"key_hash IN ({', '.join(['%s'] * len(items))}) AND " if by_key else ""
    sql = ";".join(
        [
            "SET @jf_t = NOW(6)",
            f"UPDATE {table} SET heartbeat_at = @jf_t, expires_at = @jf_t + INTERVAL"
            f" (CASE owner {case} END) MICROSECOND WHERE {keyed}(key_hash, owner) IN ({pairs})"
            " AND expires_at > @jf_t",
            f"SELECT key_hash, owner FROM {table} WHERE {keyed}(key_hash, owner) IN ({pairs})"
            " AND heartbeat_at = @jf_t",
        ]
    )
    flat = [x for h, (_, o, _) in zip(hashes, items, strict=True) for x in (h, o)]
    params: list[Any] = [x for _, o, t in items for x in (o, t * 1000)]
    params += [*(hashes if by_key else []), *flat] * 2
    sets = run(sql, params, None)
    done = {(h, o) for h, o in sets[2]}
    return [(h, o) in done for h, (_, o, _) in zip(hashes, items, strict=True)]
