"""A private, throw-away stack for the fleet and the demo: its own redis-server and SQLite file."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Self, TypeVar

import redis

from devstack import procs
from devstack.redis_server import HOST, RedisServer, RedisServerError, free_port
from jobfence.config import Settings, load_settings
from jobfence.config.settings import ENV_PREFIX

__all__ = ["HOST", "EmbeddedStack", "EmbeddedStackError", "free_port"]

#: The embedded redis-server could not be started (the same class as RedisServerError).
EmbeddedStackError = RedisServerError

_T = TypeVar("_T")


def _started(part: _T | None) -> _T:
    """A part of the stack, which exists once the stack has started."""
    if part is None:
        raise RuntimeError("EmbeddedStack is not started")
    return part


class EmbeddedStack(procs.Launcher):
    """Two private `redis-server`s (no persistence, noeviction, free ports on 127.0.0.1), one
    for locks and one for the broker, and an SQLite ledger file, all in a temporary directory
    removed on exit.

        with EmbeddedStack() as stack:
            app = create_app(stack.settings())
            subprocess.run([...], env={**os.environ, **stack.env()})

    Locks use database 0 of the lock server (`server`); the broker uses database 0 and the
    result backend database 1 of the broker server (`broker_server`). Apart, so the lock
    server can restart and lose its data (the demo's chaos does) without losing the queue.
    """

    def __init__(
        self,
        *,
        executable: str = "redis-server",
        workdir: str | Path | None = None,
        startup_timeout: float = 10.0,
        keep: bool = False,
    ) -> None:
        self.executable = executable
        self.startup_timeout = startup_timeout
        self.keep = keep
        self._given_dir = Path(workdir) if workdir is not None else None
        self._dir: Path | None = None
        self._server: RedisServer | None = None
        self._broker: RedisServer | None = None

    # -- what it offers ------------------------------------------------------------
    @property
    def workdir(self) -> Path:
        return _started(self._dir)

    @property
    def server(self) -> RedisServer:
        return _started(self._server)

    @property
    def broker_server(self) -> RedisServer:
        return _started(self._broker)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def pid(self) -> int:
        return self.server.pid

    @property
    def running(self) -> bool:
        return self._server is not None and self._server.running

    def redis_url(self, db: int = 0) -> str:
        return self.server.db_url(db)

    @property
    def lock_url(self) -> str:
        return self.redis_url(0)

    @property
    def broker_url(self) -> str:
        return self.broker_server.db_url(0)

    @property
    def result_backend(self) -> str:
        return self.broker_server.db_url(1)

    @property
    def database_path(self) -> Path:
        return self.workdir / "ledger.sqlite"

    @property
    def database_url(self) -> str:
        return f"sqlite:///{self.database_path}"

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    def env(self) -> dict[str, str]:
        """The JOBFENCE_* variables that point a process at this stack."""
        return {
            f"{ENV_PREFIX}LOCK_URL": self.lock_url,
            f"{ENV_PREFIX}BROKER_URL": self.broker_url,
            f"{ENV_PREFIX}RESULT_BACKEND": self.result_backend,
            f"{ENV_PREFIX}DATABASE_URL": self.database_url,
        }

    def settings(self, **overrides: Any) -> Settings:
        """Settings from the environment, pointed at this stack (`overrides` win)."""
        urls = {
            "lock_url": self.lock_url,
            "broker_url": self.broker_url,
            "result_backend": self.result_backend,
            "database_url": self.database_url,
        }
        return load_settings(**{**urls, **overrides})

    def client(self, db: int = 0) -> redis.Redis:
        """A new client (caller closes it; `stop()` at the latest) that fails fast instead of
        retrying."""
        return self.server.client(db=db, socket_timeout=2.0)

    # -- life cycle ----------------------------------------------------------------
    def start(self) -> Self:
        if self._server is not None:
            return self
        if shutil.which(self.executable) is None and not Path(self.executable).is_file():
            raise EmbeddedStackError(
                f"{self.executable!r} not found on PATH: install redis-server "
                "(apt-get install redis-server), or point the fleet at servers with "
                "--broker and --lock-backend"
            )
        if self._given_dir is not None:
            self._given_dir.mkdir(parents=True, exist_ok=True)
            self._dir = self._given_dir
        else:
            self._dir = Path(tempfile.mkdtemp(prefix="jobfence-stack-"))
        self._server = RedisServer(
            executable=self.executable, workdir=self._dir, startup_timeout=self.startup_timeout
        )
        self._broker = RedisServer(
            executable=self.executable,
            workdir=self._dir / "broker",
            startup_timeout=self.startup_timeout,
        )
        try:
            self._server.start()
            self._broker.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop both redis-servers (SIGTERM, SIGKILL after `timeout`), delete the directory."""
        if self._broker is not None:
            self._broker.stop(timeout)
            self._broker = None
        if self._server is not None:
            self._server.stop(timeout)
            self._server = None
        if self._dir is not None and not self.keep and self._given_dir is None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    def __repr__(self) -> str:
        where = f" at {self.lock_url}" if self.running else ""
        return f"<EmbeddedStack{where}>"
