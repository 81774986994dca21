"""MySQL/MariaDB start-up checks: the server settings under which no grant can be written."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pymysql.err import MySQLError  # type: ignore[import-untyped]  # see connection.py

from jobfence.config.findings import Finding, LockTarget
from jobfence.locks.backends.common import server_findings
from jobfence.locks.backends.mysql.connection import DEFAULT_PORT, connect_hint
from jobfence.locks.backends.probe import foreign_sql_refusal
from jobfence.locks.errors import BackendUnavailable

_SETTINGS = "SELECT @@version, @@log_bin, @@binlog_format, @@read_only, @@innodb_read_only"


class MySQLChecks:
    """The start-up half of MySQLBackend (mixed in): the server's settings, read at start-up."""

    _connect_args: dict[str, Any]

    def _run(self, sql: str, params: Any, key: str | None) -> list[Any]:
        raise NotImplementedError  # MySQLBackend's

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        def foreign() -> Finding | None:
            return foreign_sql_refusal(target, "MySQL/MariaDB", DEFAULT_PORT)

        return server_findings(target, self.server_problems, foreign)

    def server_problems(self) -> list[tuple[str, str]]:
        """What about the server breaks this backend, as (problem, fix) pairs; for start-up.

        A login or TLS set-up the server refuses is a problem too (no wait would help);
        raises BackendUnavailable if the server does not answer.
        """
        try:
            rows = self._run(_SETTINGS, (), None)[0]
        except BackendUnavailable as exc:
            args = self._connect_args
            cause = exc.cause if isinstance(exc.cause, MySQLError) else None
            hint = cause and connect_hint(cause, args.get("host", ""), args.get("user"))
            if not hint:
                raise
            return [(f"cannot connect to the MySQL lock server ({cause})", hint)]
        version, log_bin, binlog_format, read_only, innodb_read_only = rows[0]
        return server_problems(
            version=str(version),
            log_bin=bool(int(log_bin)),
            binlog_format=str(binlog_format),
            read_only=bool(int(read_only)) or bool(int(innodb_read_only)),
        )


def server_problems(
    *, version: str, log_bin: bool, binlog_format: str, read_only: bool
) -> list[tuple[str, str]]:
    """The server settings under which no grant can be written, with their fixes."""
    out: list[tuple[str, str]] = []
    if log_bin and binlog_format.upper() == "STATEMENT":
        out.append(
            (
                f"the MySQL server ({version}) logs binlog_format=STATEMENT, under which InnoDB "
                "refuses every write made at READ COMMITTED (error 1665), which the lock "
                "table needs (REPEATABLE READ deadlocks acquires of absent keys on gap locks)",
                "set binlog_format=ROW (MySQL 8's default) or MIXED (MariaDB's) on the server",
            )
        )
    if read_only:
        out.append(
            (
                f"the MySQL server ({version}) is read-only (a replica?): no lock can be taken",
                "point the lock URL at the primary",
            )
        )
    return out
