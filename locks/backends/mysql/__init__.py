"""The MySQL/MariaDB lock backend as one package; `MySQLBackend` and what callers use, re-exported.

Its URL and TLS options, its store, its semaphores and its start-up checks:

- tables.py: the tables' names and DDL; statements.py: each call's SQL, as a table
- connection.py: the URL's connect arguments, the idle connections, connect failures' hints
- tls.py: the TLS options and context, a connection refusing a TLS-less server
- backend.py: MySQLBackend, the lock core; records.py: job records, claims, the sweep
- semaphores.py: the semaphore half; checks.py: the start-up checks
"""

from __future__ import annotations

from jobfence.locks.backends.mysql.backend import (
    ATTEMPTS,
    NO_SUCH_TABLE,
    POLL_CAP,
    POLL_FIRST,
    RETRY_ERRORS,
    MySQLBackend,
)
from jobfence.locks.backends.mysql.checks import server_problems
from jobfence.locks.backends.mysql.connection import (
    DEFAULT_PORT,
    SCHEMES,
    URL_OPTIONS,
    connect_hint,
    parse_url,
)
from jobfence.locks.backends.mysql.records import PURGE_BATCH, PURGE_EVERY
from jobfence.locks.backends.mysql.semaphores import MySQLSemaphores
from jobfence.locks.backends.mysql.statements import extend_many
from jobfence.locks.backends.mysql.tables import NOW_US, key_hash
from jobfence.locks.backends.mysql.tls import (
    SSL_MODES,
    TLS_FILES,
    TlsFirstConnection,
    TlsNotOffered,
    asks_tls,
    connect_for_sqlalchemy,
    tls_context,
    tls_options,
)

__all__ = [
    "ATTEMPTS", "DEFAULT_PORT", "NOW_US", "NO_SUCH_TABLE", "POLL_CAP", "POLL_FIRST",
    "PURGE_BATCH", "PURGE_EVERY", "RETRY_ERRORS", "SCHEMES", "SSL_MODES", "TLS_FILES",
    "URL_OPTIONS", "MySQLBackend", "MySQLSemaphores", "TlsFirstConnection", "TlsNotOffered",
    "asks_tls", "connect_for_sqlalchemy", "connect_hint", "extend_many", "key_hash",
    "parse_url", "server_problems", "tls_context", "tls_options",
]  # fmt: skip
