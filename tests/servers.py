"""Private Redis servers, throw-away SQL databases and process helpers for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.pool import NullPool

from jobfence.worker import procs
from jobfence.worker.redis_server import HOST, RedisServer, RedisServerError, free_port

__all__ = [
    "HOST",
    "MARIADB_ADMIN_URL",
    "POSTGRES_ADMIN_URL",
    "MariaDBDatabase",
    "PostgresDatabase",
    "ProcessGroup",
    "RedisServer",
    "RedisServerError",
    "free_port",
    "stop_process",
    "unique_name",
    "wait_for",
]

T = TypeVar("T")

POSTGRES_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
MARIADB_ADMIN_URL = "mysql+pymysql://root@127.0.0.1:3306/test"


# --------------------------------------------------------------------------- helpers


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.01,
    message: str | Callable[[], str] = "condition not met",
    *,
    error: type[Exception] = AssertionError,
) -> T:
    """Poll ``predicate`` until it returns a truthy value, which is returned.

    Raises ``error`` (``AssertionError`` unless told) with ``message`` (a string, or a
    callable building one lazily) if the predicate is still falsy after ``timeout`` seconds.
    The predicate is always evaluated at least once and once more at the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            text = message() if callable(message) else message
            raise error(f"timed out after {timeout:.2f}s: {text}")
        time.sleep(min(interval, remaining))


def unique_name(prefix: str = "jobfence_test") -> str:
    """A short name unique across processes and runs, safe as a SQL identifier."""
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:10]}"


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0, *, group: bool = False) -> int:
    """Stop ``proc``: SIGCONT + SIGTERM, SIGKILL after ``timeout``; always reap it.

    With ``group=True`` the signals go to the process group led by ``proc`` (start it with
    ``start_new_session=True``); either way whatever is left of that group gets SIGKILL once
    the leader has exited, so no child survives. Returns the exit code.
    """
    return procs.stop([proc], timeout=timeout, group=group)[0]


# --------------------------------------------------------------------------- SQL databases


class _ScratchDatabase:
    """A uniquely named database created on construction and removed by ``drop()``."""

    dialect_name = ""

    def __init__(self, admin_url: str, *, prefix: str = "jobfence_test") -> None:
        self.admin_url = admin_url
        self.name = unique_name(prefix)
        self._dropped = False
        with self._admin_engine().connect() as conn:
            self._create(conn)
        self._finalizer = weakref.finalize(self, _drop_quietly, type(self), admin_url, self.name)

    @property
    def url(self) -> str:
        return (
            sa.make_url(self.admin_url)
            .set(database=self.name)
            .render_as_string(hide_password=False)
        )

    def engine(self, **kwargs: Any) -> Engine:
        """A new SQLAlchemy engine on this database; the caller disposes of it."""
        return sa.create_engine(self.url, **kwargs)

    def _admin_engine(self) -> Engine:
        return sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)

    def _create(self, conn: sa.Connection) -> None:
        raise NotImplementedError

    @classmethod
    def _drop_by_name(cls, conn: sa.Connection, name: str) -> None:
        raise NotImplementedError

    def drop(self) -> None:
        """Disconnect everyone from the database and drop it; idempotent."""
        if self._dropped:
            return
        engine = self._admin_engine()
        try:
            with engine.connect() as conn:
                self._drop_by_name(conn, self.name)
        finally:
            engine.dispose()
        self._dropped = True
        self._finalizer.detach()

    @classmethod
    def reachable(cls, admin_url: str, timeout: float = 3.0) -> str | None:
        """``None`` if the server answers ``SELECT 1``, else the reason it does not."""
        engine = sa.create_engine(
            admin_url, poolclass=NullPool, connect_args={"connect_timeout": int(timeout)}
        )
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        except Exception as exc:
            return f"{cls.dialect_name} at {sa.make_url(admin_url).host} unreachable: {exc}"
        finally:
            engine.dispose()
        return None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.drop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}{' dropped' if self._dropped else ''}>"


def _drop_quietly(cls: type[_ScratchDatabase], admin_url: str, name: str) -> None:
    """Finalizer: best-effort drop of a database nobody dropped explicitly."""
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with contextlib.suppress(Exception), engine.connect() as conn:
            cls._drop_by_name(conn, name)
    finally:
        engine.dispose()


class PostgresDatabase(_ScratchDatabase):
    """A fresh database on the local PostgreSQL: ``postgresql+psycopg://postgres@.../<name>``."""

    dialect_name = "PostgreSQL"

    def __init__(
        self, admin_url: str = POSTGRES_ADMIN_URL, *, prefix: str = "jobfence_test"
    ) -> None:
        super().__init__(admin_url, prefix=prefix)

    def _create(self, conn: sa.Connection) -> None:
        conn.execute(sa.text(f'CREATE DATABASE "{self.name}"'))

    @classmethod
    def _drop_by_name(cls, conn: sa.Connection, name: str) -> None:
        # Refuse new sessions, end the current ones (on this database only), then drop.
        # A pool may reconnect between the two steps, so retry for a short while.
        exists = conn.execute(
            sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
        ).first()
        if exists is None:
            return
        conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
        deadline = time.monotonic() + 10.0
        while True:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )
            try:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
                return
            except OperationalError:
                # 55006 object_in_use: a backend had not exited yet.
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)


class MariaDBDatabase(_ScratchDatabase):
    """A fresh database on the local MariaDB: ``mysql+pymysql://root@.../<name>``."""

    dialect_name = "MariaDB"

    def __init__(
        self, admin_url: str = MARIADB_ADMIN_URL, *, prefix: str = "jobfence_test"
    ) -> None:
        super().__init__(admin_url, prefix=prefix)

    def _create(self, conn: sa.Connection) -> None:
        conn.execute(
            sa.text(f"CREATE DATABASE `{self.name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        )

    @classmethod
    def _drop_by_name(cls, conn: sa.Connection, name: str) -> None:
        # Kill sessions using this database so their metadata locks cannot block the DROP.
        ids = conn.execute(
            sa.text(
                "SELECT ID FROM information_schema.PROCESSLIST "
                "WHERE DB = :name AND ID <> CONNECTION_ID()"
            ),
            {"name": name},
        ).scalars()
        for session_id in list(ids):
            with contextlib.suppress(DBAPIError):  # it may have gone already
                conn.execute(sa.text(f"KILL CONNECTION {int(session_id)}"))
        conn.execute(sa.text("SET SESSION lock_wait_timeout = 30"))
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))


# --------------------------------------------------------------------------- processes


class ProcessGroup:
    """Spawns helper processes (e.g. Celery workers) and guarantees they are all stopped.

    Each process leads its own session/process group, so ``stop_all()`` also stops its
    children (a prefork pool, say). Output goes to a log file per process.
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None) -> None:
        self._own_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="jobfence-procs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    def spawn(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        name: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``args`` in a new session; ``env`` entries are added to ``os.environ``."""
        label = name or f"{Path(args[0]).name}-{len(self._procs)}"
        log = open(self.log_dir / f"{label}.log", "ab")  # noqa: SIM115
        try:
            proc = procs.spawn(args, env={**os.environ, **(env or {})}, stdout=log, cwd=cwd)
        except BaseException:
            log.close()
            raise
        self._procs.append((proc, log))
        return proc

    def log_of(self, proc: subprocess.Popen[bytes], lines: int = 60) -> str:
        for candidate, log in self._procs:
            if candidate is proc:
                return procs.tail(log.name, lines)
        raise KeyError(proc.pid)

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
        """Stop one process and its group, and forget it; returns its exit code."""
        code = stop_process(proc, timeout, group=True)
        for entry in [e for e in self._procs if e[0] is proc]:
            self._procs.remove(entry)  # stop_all must never signal its (reusable) pgid again
            entry[1].close()
        return code

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every group, SIGKILL whatever is left after ``timeout``, reap all."""
        entries, self._procs = self._procs, []
        try:
            procs.stop([proc for proc, _ in entries], timeout=timeout, group=True)
        finally:
            for _, log in entries:
                log.close()
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()
