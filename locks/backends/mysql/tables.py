"""The MySQL/MariaDB tables: their names per prefix, their DDL, and the key hash keying them."""

from __future__ import annotations

import hashlib

from jobfence.locks.errors import LockError

# Server microseconds since the epoch: the session runs at time_zone '+00:00', so NOW(6) is
# UTC and this is plain arithmetic (no time zone table, no DST gap).
NOW_US = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', NOW(6))"

# The columns every table keys by: the SHA-256 hex of the lock key (`key_hash`).
_KEY = "key_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL"
_TEXT = "TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
_OWNER = "owner CHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL"

# The lock tables, as templates of their quoted names ({locks}, {jobs}, {fence}, {marks}).
LOCK_DDL = (
    f"""CREATE TABLE IF NOT EXISTS {{locks}} (
  {_KEY} PRIMARY KEY,
  lock_key VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  owner CHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
  fence BIGINT UNSIGNED NOT NULL,
  expires_at DATETIME(6) NOT NULL,
  acquired_at DATETIME(6) NOT NULL,
  heartbeat_at DATETIME(6) NOT NULL,
  task_id {_TEXT}, task_name {_TEXT}, host {_TEXT}, pid BIGINT NOT NULL,
  process_start {_TEXT}, fingerprint {_TEXT},
  KEY (expires_at)
) ENGINE=InnoDB""",
    f"""CREATE TABLE IF NOT EXISTS {{jobs}} (
  {_KEY} PRIMARY KEY,
  lock_key VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  state VARCHAR(8) CHARACTER SET ascii NOT NULL,
  fingerprint {_TEXT}, result LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  fence BIGINT UNSIGNED NOT NULL,
  finished_at DATETIME(6) NOT NULL,
  expires_at DATETIME(6) NOT NULL,
  KEY (expires_at)
) ENGINE=InnoDB""",
    # One counter row, advanced inside each acquire transaction: a committed InnoDB
    # write, so a crash never hands a value out twice (AUTO_INCREMENT repeats on MySQL
    # 5.7, a bare NEXTVAL of a MariaDB SEQUENCE repeats after kill -9).
    """CREATE TABLE IF NOT EXISTS {fence} (
  id TINYINT UNSIGNED NOT NULL PRIMARY KEY,
  v BIGINT UNSIGNED NOT NULL
) ENGINE=InnoDB""",
    f"INSERT IGNORE INTO {{fence}} (id, v) VALUES (1, {NOW_US})",
    f"""CREATE TABLE IF NOT EXISTS {{marks}} (
  {_KEY},
  kind CHAR(1) CHARACTER SET ascii NOT NULL,
  value {_TEXT},
  n BIGINT NOT NULL,
  expires_at DATETIME(6) NOT NULL,
  PRIMARY KEY (key_hash, kind),
  KEY (expires_at)
) ENGINE=InnoDB""",
)

# The rate limiters' table (locks/ratelimit.py): GCRA state `tat` and the answer of the
# last step beside it, in µs on the server clock.
RATE_DDL = (
    """CREATE TABLE IF NOT EXISTS {rates} (
  key_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
  tat DOUBLE NOT NULL,
  admitted TINYINT NOT NULL,
  wait_us DOUBLE NOT NULL,
  now_us DOUBLE NOT NULL
) ENGINE=InnoDB""",
)

# The semaphores' tables ({state}, {slots}, {waiters}), made on a semaphore's first use.
SEMAPHORE_DDL = (
    f"""CREATE TABLE IF NOT EXISTS {{state}} (
  {_KEY} PRIMARY KEY, fence BIGINT UNSIGNED NOT NULL, ticket BIGINT UNSIGNED NOT NULL
) ENGINE=InnoDB""",
    f"""CREATE TABLE IF NOT EXISTS {{slots}} (
  {_KEY}, {_OWNER}, fence BIGINT UNSIGNED NOT NULL, expires_at DATETIME(6) NOT NULL,
  heartbeat_at DATETIME(6) NOT NULL,
  holder TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  PRIMARY KEY (key_hash, owner)
) ENGINE=InnoDB""",
    # Waiters in ticket order: tickets are drawn from the semaphore's row while it is
    # locked, so they increase in the order attempts are serialised.
    f"""CREATE TABLE IF NOT EXISTS {{waiters}} (
  {_KEY}, {_OWNER}, ticket BIGINT UNSIGNED NOT NULL, expires_at DATETIME(6) NOT NULL,
  PRIMARY KEY (key_hash, owner), KEY (key_hash, ticket)
) ENGINE=InnoDB""",
)


def quote_name(name: str) -> str:
    """`name` as a quoted MySQL identifier; LockError past MySQL's 64 characters."""
    if len(name) > 64:
        raise LockError(
            f"table name {name!r} is longer than MySQL's 64 characters; "
            "set JOBFENCE_KEY_PREFIX to a shorter prefix"
        )
    return "`" + name.replace("`", "``") + "`"


def lock_tables(prefix: str) -> dict[str, str]:
    """The quoted names of the lock tables, by their role (LOCK_DDL's fields).

    Named apart from the SQL effects' `{prefix}_jobs` and the guards' `{prefix}_fences`,
    which may live in the same database."""
    names = {"locks": "leases", "jobs": "records", "fence": "fence", "marks": "marks"}
    return {t: quote_name(f"{prefix}_lock_{n}") for t, n in names.items()}


def semaphore_tables(prefix: str) -> dict[str, str]:
    """The quoted names of the semaphore tables, by their role (SEMAPHORE_DDL's fields)."""
    return {
        n: "`" + f"{prefix}_sem_{n}".replace("`", "``") + "`"
        for n in ("state", "slots", "waiters")
    }


def filled(templates: tuple[str, ...], names: dict[str, str]) -> list[str]:
    """The statements of `templates` with the quoted table `names` filled in."""
    return [template.format(**names) for template in templates]


def key_hash(key: str) -> str:
    """The primary key of `key`'s rows: SHA-256 hex (keys run to 512 characters)."""
    return hashlib.sha256(key.encode()).hexdigest()
