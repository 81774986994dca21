"""Private Redis servers, throw-away SQL databases and process helpers for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self, TypeVar

import redis
import sqlalchemy as sa
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.pool import NullPool

__all__ = [
    "MARIADB_ADMIN_URL",
    "POSTGRES_ADMIN_URL",
    "MariaDBDatabase",
    "PostgresDatabase",
    "ProcessGroup",
    "RedisServer",
    "free_port",
    "stop_process",
    "unique_name",
    "wait_for",
]

T = TypeVar("T")

HOST = "127.0.0.1"
POSTGRES_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
MARIADB_ADMIN_URL = "mysql+pymysql://root@127.0.0.1:3306/test"


# --------------------------------------------------------------------------- helpers


def free_port(host: str = HOST) -> int:
    """Return a TCP port that was free on ``host`` a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.01,
    message: str | Callable[[], str] = "condition not met",
) -> T:
    """Poll ``predicate`` until it returns a truthy value, which is returned.

    Raises ``AssertionError`` with ``message`` (a string, or a callable building one lazily)
    if the predicate is still falsy after ``timeout`` seconds. The predicate is always
    evaluated at least once and once more at the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:.2f}s: {text}")
        time.sleep(min(interval, remaining))


def unique_name(prefix: str = "jobfence_test") -> str:
    """A short name unique across processes and runs, safe as a SQL identifier."""
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:10]}"


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _signal_process(proc: subprocess.Popen[Any], sig: int, group: bool) -> None:
    """Send ``sig`` to ``proc`` or to the process group it leads; a vanished target is fine.

    A single process is only signalled while it is unreaped, so its pid cannot have been
    reused. A group is signalled even after its leader was reaped: its pgid stays reserved
    while any member (e.g. an orphaned pool child) is alive.
    """
    if not group and proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)


def _wait_exited(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` for ``proc`` to exit WITHOUT reaping it (its pid stays ours)."""
    deadline = time.monotonic() + timeout
    while proc.returncode is None:
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere
            proc.poll()
            return True
        if info is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0, *, group: bool = False) -> int:
    """Stop ``proc``: SIGCONT + SIGTERM, SIGKILL after ``timeout``; always reap it.

    With ``group=True`` the signals go to the process group led by ``proc`` (start it with
    ``start_new_session=True``) and, once the leader has exited, whatever is left of the
    group gets SIGKILL, so no child survives. Returns the exit code.
    """
    _signal_process(proc, signal.SIGCONT, group)  # a stopped process cannot act on SIGTERM
    _signal_process(proc, signal.SIGTERM, group)
    _wait_exited(proc, timeout)
    # The leader is at most a zombie here (not reaped), so its pid/pgid cannot be reused yet.
    _signal_process(proc, signal.SIGKILL, group)
    return proc.wait()


# --------------------------------------------------------------------------- redis


def _kill_and_reap(proc: subprocess.Popen[bytes], workdir: str | None) -> None:
    """Last-resort cleanup used by the finalizer: never leave a redis-server behind."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)


class RedisServerError(RuntimeError):
    """A private redis-server could not be started."""


class RedisServer:
    """A private, non-persistent ``redis-server`` on 127.0.0.1, owned by this process.

    Usage::

        with RedisServer() as server:
            server.client().set("k", "v")

    The port is chosen when first started and kept for the object's lifetime, so
    ``restart()`` comes back on the same port (with an empty data set).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        executable: str = "redis-server",
        extra_args: Sequence[str] = (),
        startup_timeout: float = 10.0,
    ) -> None:
        self._port: int | None = port
        self._executable = executable
        self._extra_args = tuple(extra_args)
        self._startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdio: IO[bytes] | None = None
        self._workdir: str | None = None
        self._paused = False
        self._clients: list[redis.Redis] = []
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- properties -----------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("RedisServer has not been started yet")
        return self._port

    @property
    def host(self) -> str:
        return HOST

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("RedisServer is not running")
        return self._proc.pid

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise RuntimeError("RedisServer has not been started yet")
        return Path(self._workdir)

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def paused(self) -> bool:
        return self._paused

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log and of its stdout/stderr."""
        if self._workdir is None:
            return "<not started>"
        return (
            f"--- {self.log_path} ---\n{_tail(self.log_path, lines)}\n"
            f"--- stdout/stderr ---\n{_tail(self.workdir / 'stdio.log', lines)}"
        )

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> Self:
        """Start the server and wait until it answers PING; idempotent while running.

        The first start picks a free port (retrying if another process grabs it first);
        later starts reuse that port.
        """
        if self.running:
            return self
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="jobfence-redis-")
        choose_port = self._port is None
        attempts = 5 if choose_port else 1
        for attempt in range(attempts):
            if choose_port:
                self._port = free_port()
            try:
                self._spawn_and_wait()
                return self
            except RedisServerError as exc:
                # free_port() is racy: someone may bind the port before redis-server does.
                if attempt + 1 < attempts and "Address already in use" in str(exc):
                    continue
                if choose_port:
                    self._port = None
                raise
        raise AssertionError("unreachable")

    def _command(self) -> list[str]:
        assert self._workdir is not None and self._port is not None
        return [
            self._executable,
            "--port", str(self._port),
            "--bind", HOST,
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._workdir,
            "--maxmemory-policy", "noeviction",
            "--logfile", str(Path(self._workdir) / "redis.log"),
            "--loglevel", "notice",
            *self._extra_args,
        ]  # fmt: skip

    def _spawn_and_wait(self) -> None:
        assert self._workdir is not None
        self._stdio = open(Path(self._workdir) / "stdio.log", "ab")  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=self._stdio,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the terminal must not hit the server first
            )
        except OSError as exc:
            self._close_stdio()
            raise RedisServerError(f"cannot run {self._executable!r}: {exc}") from exc
        self._proc = proc
        self._paused = False
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _kill_and_reap, proc, self._workdir)

        probe = redis.Redis(
            host=HOST,
            port=self.port,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        deadline = time.monotonic() + self._startup_timeout
        try:
            while True:
                if proc.poll() is not None:
                    self._forget_process()
                    raise RedisServerError(
                        f"redis-server on port {self._port} exited with code "
                        f"{proc.returncode} during start-up\n{self.log_tail()}"
                    )
                try:
                    if probe.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() >= deadline:
                    _kill_and_reap(proc, None)
                    self._forget_process()
                    raise RedisServerError(
                        f"redis-server on port {self._port} did not answer PING within "
                        f"{self._startup_timeout:.1f}s\n{self.log_tail()}"
                    )
                time.sleep(0.01)
        finally:
            probe.close()

    def _forget_process(self) -> None:
        # The finalizer stays armed: reaping a dead process is harmless and it still owns
        # the temp dir if this object is dropped without stop().
        self._proc = None
        self._paused = False
        self._close_stdio()

    def _close_stdio(self) -> None:
        if self._stdio is not None:
            self._stdio.close()
            self._stdio = None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, SIGKILL after ``timeout``), reap, delete the temp dir."""
        self._close_clients()
        if self._proc is not None:
            stop_process(self._proc, timeout)  # resumes a paused server first
            self._forget_process()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def kill(self) -> None:
        """SIGKILL the server (a crash) and reap it; the temp dir and port are kept."""
        if self._proc is not None:
            _kill_and_reap(self._proc, None)
            self._forget_process()

    def restart(self) -> Self:
        """Kill the server and start a new one on the same port; all data is lost."""
        self.kill()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing is answered."""
        if not self.running:
            raise RuntimeError("RedisServer is not running")
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if not self.running:
            raise RuntimeError("RedisServer is not running")
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Context manager: paused inside the block, resumed on exit (even on error)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    # -- clients --------------------------------------------------------------------

    def client(self, **kwargs: Any) -> redis.Redis:
        """A ``redis.Redis`` to db 0 of this server; closed by ``stop()``.

        Keyword arguments are passed through (e.g. ``socket_timeout=0.2``,
        ``decode_responses=True``). Unlike redis-py's default (3 retries with exponential
        backoff, which turns a 0.2 s timeout into several seconds), each command is tried
        once unless a ``retry`` is given.
        """
        options: dict[str, Any] = {
            "socket_connect_timeout": 2.0,
            "socket_timeout": 5.0,
            "retry": Retry(NoBackoff(), 0),
        }
        options.update(kwargs)
        client = redis.Redis(host=HOST, port=self.port, db=0, **options)
        self._clients.append(client)
        return client

    def _close_clients(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()

    # -- context manager ------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "paused" if self._paused else ("running" if self.running else "stopped")
        return f"<RedisServer {HOST}:{self._port} {state}>"


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
        full_env = {**os.environ, **(env or {})}
        try:
            proc = subprocess.Popen(
                list(args),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        except BaseException:
            log.close()
            raise
        self._procs.append((proc, log))
        return proc

    def log_of(self, proc: subprocess.Popen[bytes], lines: int = 60) -> str:
        for candidate, log in self._procs:
            if candidate is proc:
                return _tail(Path(log.name), lines)
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
        procs, self._procs = self._procs, []
        for proc, _ in procs:
            _signal_process(proc, signal.SIGCONT, True)
            _signal_process(proc, signal.SIGTERM, True)
        deadline = time.monotonic() + timeout
        for proc, log in procs:
            _wait_exited(proc, max(0.0, deadline - time.monotonic()))
            _signal_process(proc, signal.SIGKILL, True)
            proc.wait()
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
