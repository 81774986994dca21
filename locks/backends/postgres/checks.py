"""PostgreSQL start-up checks: the server reachable, its sessions as the statements need them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jobfence.config.findings import Finding, LockTarget, refuse, warn
from jobfence.config.urls import redact
from jobfence.locks.backends.postgres.connection import DEFAULT_PORT, OPTIONS_FIX
from jobfence.locks.backends.probe import foreign_sql_refusal
from jobfence.locks.errors import BackendUnavailable

_SESSION = (
    "SELECT current_setting('server_version_num')::int, "
    "current_setting('transaction_isolation')"
)


class PostgresChecks:
    """The start-up half of PostgresBackend (mixed in)."""

    def _run(self, what: str, key: str | None, sql: str, params: Any) -> list[tuple[Any, ...]]:
        raise NotImplementedError  # PostgresBackend's

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        """Reachable, and its sessions as its statements need them (`session_problems`)."""
        setting, url = target.setting, target.url
        try:
            problems = self.session_problems()
        except BackendUnavailable as exc:
            yield from _unreachable(target, exc)
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
        version, isolation = self._run("session check", None, _SESSION, None)[0]
        problems = []
        if version < 110000:
            problems.append(f"PostgreSQL {version // 10000} is too old (11 or later needed)")
        if isolation != "read committed":
            problems.append(
                f"sessions run at isolation {isolation!r}, not 'read committed' (a pooler "
                "dropped the startup options?), so racing acquires fail instead of waiting"
            )
        return problems


def _unreachable(target: LockTarget, exc: BackendUnavailable) -> Iterator[Finding]:
    """The finding for a lock database that did not answer the start-up check."""
    setting, url = target.setting, target.url
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
