"""A private MariaDB server (a child `mariadbd` on a free port), optionally serving TLS."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import pymysql  # type: ignore[import-untyped]

from devstack import procs
from devstack.redis_server import HOST, free_port

__all__ = ["MariaDBServer", "MariaDBServerError", "unavailable"]


class MariaDBServerError(RuntimeError):
    """A private MariaDB server could not be started or set up."""


def _binary(*names: str) -> str | None:
    for name in names:
        for where in (shutil.which(name), f"/usr/sbin/{name}"):
            if where and os.access(where, os.X_OK):
                return where
    return None


def unavailable() -> str | None:
    """None if a private server can be started here, else why not (for pytest.skip)."""
    if _binary("mariadbd", "mysqld") is None:
        return "mariadbd not found: install mariadb-server"
    if _binary("mariadb-install-db", "mysql_install_db") is None:
        return "mariadb-install-db not found: install mariadb-server"
    return None


class MariaDBServer(procs.SingleServer):
    """One `mariadbd` with its own data directory, socket and port, stopped by its pid.

        with MariaDBServer(tls=(ca, cert, key)) as db:
            db.admin("CREATE USER ...")

    root connects through the unix socket without a password (`admin`); tests make the
    users they need. With `tls` the server offers TLS with that CA, certificate and key.
    """

    def __init__(
        self,
        *,
        tls: tuple[Path, Path, Path] | None = None,
        startup_timeout: float = 60.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.tls = tls
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self._port: int | None = None
        self._dir = procs.Workdir(None, "jobfence-mariadb-")
        self._server = procs.ServerProcess("mariadbd", error=MariaDBServerError)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("MariaDBServer has not been started yet")
        return self._port

    @property
    def socket_path(self) -> Path:
        return self.workdir / "mysqld.sock"

    def _install(self, data: Path) -> None:
        install = _binary("mariadb-install-db", "mysql_install_db")
        assert install is not None
        user = ["--user=root"] if os.getuid() == 0 else []
        out = subprocess.run(
            [install, "--no-defaults", f"--datadir={data}", "--skip-test-db",
             "--auth-root-authentication-method=socket", *user],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise MariaDBServerError(f"mariadb-install-db failed:\n{out.stderr[-2000:]}")

    def _command(self, data: Path) -> list[str]:
        server = _binary("mariadbd", "mysqld")
        assert server is not None
        args = [
            server, "--no-defaults", f"--datadir={data}", f"--socket={self.socket_path}",
            f"--pid-file={self.workdir / 'mysqld.pid'}", f"--port={self.port}",
            f"--bind-address={HOST}", "--skip-name-resolve", "--innodb-buffer-pool-size=16M",
            "--innodb-log-file-size=8M", "--skip-log-bin", "--performance-schema=OFF",
            f"--log-error={self.workdir / 'error.log'}",
        ]  # fmt: skip
        if os.getuid() == 0:
            args.append("--user=root")  # mariadbd refuses to run as root without it
        if self.tls is not None:
            ca, cert, key = self.tls
            args += [f"--ssl-ca={ca}", f"--ssl-cert={cert}", f"--ssl-key={key}"]
        return [*args, *self.extra_args]

    def start(self) -> Self:
        """Install a data directory, start the server, return once root can log in."""
        if self.running:
            return self
        reason = unavailable()
        if reason is not None:
            raise MariaDBServerError(reason)
        self._dir.make()
        data = self.workdir / "data"
        if not data.exists():
            self._install(data)
        if self._port is None:
            self._port = free_port(HOST)
        self._server.what = f"mariadbd on port {self.port}"
        self._server.spawn(
            self._command(data), log_path=self.workdir / "mariadbd.out", cwd=self.workdir
        )
        self._server.wait_ready(self._ready, self.startup_timeout, interval=0.05)
        return self

    def _ready(self) -> bool:
        try:
            self.admin("SELECT 1")
        except Exception:
            return False
        return True

    def admin(self, sql: str, params: Any = None) -> Any:
        """Run one statement as root over the unix socket; its rows."""
        conn = pymysql.connect(unix_socket=str(self.socket_path), user="root",
                               connect_timeout=2, autocommit=True)  # fmt: skip
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchall()
        finally:
            conn.close()

    def log_tail(self, lines: int = 40) -> str:
        return procs.tail(self.workdir / "error.log", lines)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (SIGKILL after `timeout`), reap, remove the directory."""
        self._server.stop(timeout)
        self._dir.remove()

    def close(self) -> None:
        self.stop()
