"""A private PgBouncer (a child `pgbouncer` on a free port) pooling in front of a PostgreSQL."""

from __future__ import annotations

import os
import pwd
import shutil
from collections.abc import Sequence
from typing import Any, Self

from devstack import procs
from devstack.redis_server import HOST, free_port

__all__ = ["PgBouncer", "PgBouncerError", "unavailable"]

OS_USER = "postgres"  # pgbouncer refuses to run as root


class PgBouncerError(RuntimeError):
    """A private PgBouncer could not be started."""


def _binary() -> str | None:
    for where in (shutil.which("pgbouncer"), "/usr/sbin/pgbouncer"):
        if where and os.access(where, os.X_OK):
            return where
    return None


def unavailable() -> str | None:
    """None if a private PgBouncer can be started here, else why not (for pytest.skip)."""
    if _binary() is None:
        return "pgbouncer not found: install pgbouncer (.ci/setup does)"
    if os.geteuid() != 0:
        return "a private PgBouncer runs as the postgres OS user: needs root"
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        return f"no `{OS_USER}` OS user to run a private PgBouncer"
    return None


class PgBouncer(procs.SingleServer):
    """One `pgbouncer` in `pool_mode` (transaction unless told) on its own port, with trust
    auth, forwarding every database name to the PostgreSQL at `server` (host, port):

        with PgBouncer() as bouncer:
            url = bouncer.url_for("mydb")   # postgresql+psycopg://postgres@127.0.0.1:<port>/mydb

    `pool_size` server connections per database and user, so more clients than that share
    them: each transaction may run on another server session. `ignore_startup_parameters`
    is what the config says (PgBouncer refuses a client sending any other, `options` too).
    """

    def __init__(
        self,
        *,
        server: tuple[str, int] = ("127.0.0.1", 5432),
        pool_mode: str = "transaction",
        pool_size: int = 4,
        ignore_startup_parameters: Sequence[str] = ("options",),
        users: Sequence[str] = ("postgres",),
        startup_timeout: float = 30.0,
    ) -> None:
        self.server = server
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.ignore_startup_parameters = tuple(ignore_startup_parameters)
        self.users = tuple(users)
        self.startup_timeout = startup_timeout
        self._port: int | None = None
        self._dir = procs.Workdir(None, "jobfence-pgbouncer-")
        self._server = procs.ServerProcess("pgbouncer", error=PgBouncerError)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("PgBouncer has not been started yet")
        return self._port

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, database: str, user: str = "postgres") -> str:
        return f"postgresql+psycopg://{user}@{HOST}:{self.port}/{database}"

    def _config(self) -> str:
        host, port = self.server
        ignored = ",".join(self.ignore_startup_parameters)
        return "\n".join([
            "[databases]",
            f"* = host={host} port={port}",
            "[pgbouncer]",
            f"listen_addr = {HOST}",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.workdir / 'userlist.txt'}",
            f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.pool_size}",
            "max_client_conn = 500",
            f"ignore_startup_parameters = {ignored}" if ignored else "",
            "server_login_retry = 1",
            "log_connections = 0",
            "log_disconnections = 0",
            "",
        ])  # fmt: skip

    def _as_os_user(self) -> dict[str, Any]:
        user = pwd.getpwnam(OS_USER)
        return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def start(self) -> Self:
        """Write the config, start pgbouncer, return once a client gets `SELECT 1` through."""
        if self.running:
            return self
        reason = unavailable()
        if reason is not None:
            raise PgBouncerError(reason)
        workdir = self._dir.make()
        os.chmod(workdir, 0o755)  # the postgres OS user reads its config here
        if self._port is None:
            self._port = free_port(HOST)
        (workdir / "userlist.txt").write_text("".join(f'"{u}" ""\n' for u in self.users))
        (workdir / "pgbouncer.ini").write_text(self._config())
        binary = _binary()
        assert binary is not None
        self._server.what = f"pgbouncer on port {self.port}"
        self._server.spawn(
            [binary, str(workdir / "pgbouncer.ini")], log_path=workdir / "pgbouncer.log",
            cwd=workdir, **self._as_os_user(),
        )  # fmt: skip
        self._server.wait_ready(self._ready, self.startup_timeout, interval=0.05)
        return self

    def _ready(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(host=HOST, port=self.port, user=self.users[0],
                                 dbname="postgres", connect_timeout=2) as conn:  # fmt: skip
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    def log_tail(self, lines: int = 40) -> str:
        return self._server.tail(lines)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after `timeout`), reap, remove the directory."""
        self._server.stop(timeout)
        self._dir.remove()

    def close(self) -> None:
        self.stop()

    def __repr__(self) -> str:
        pid = self.pid if self.running else None
        return f"<PgBouncer {HOST}:{self._port} {self.pool_mode} pid={pid}>"
