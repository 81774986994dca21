"""A private, throw-away stack for the fleet and the demo: its own redis-server and SQLite file."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from config import Settings, load_settings
from config.settings import ENV_PREFIX
from worker import procs

HOST = "127.0.0.1"


class EmbeddedStackError(RuntimeError):
    """The embedded redis-server could not be started."""


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class EmbeddedStack:
    """A private `redis-server` (no persistence, noeviction, a free port on 127.0.0.1) and an
    SQLite ledger file, both in a temporary directory removed on exit.

        with EmbeddedStack() as stack:
            app = create_app(stack.settings())
            subprocess.run([...], env={**os.environ, **stack.env()})

    Locks use database 0, the broker 1 and the result backend 2 of that one server.
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
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- what it offers ------------------------------------------------------------
    @property
    def workdir(self) -> Path:
        if self._dir is None:
            raise RuntimeError("EmbeddedStack is not started")
        return self._dir

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("EmbeddedStack is not started")
        return self._port

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("EmbeddedStack is not started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and not procs.exited(self._proc)

    def redis_url(self, db: int = 0) -> str:
        return f"redis://{HOST}:{self.port}/{db}"

    @property
    def lock_url(self) -> str:
        return self.redis_url(0)

    @property
    def broker_url(self) -> str:
        return self.redis_url(1)

    @property
    def result_backend(self) -> str:
        return self.redis_url(2)

    @property
    def database_path(self) -> Path:
        return self.workdir / "ledger.sqlite"

    @property
    def database_url(self) -> str:
        return f"sqlite:///{self.database_path}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

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
        """A new client (caller closes it) that fails fast instead of retrying."""
        return redis.Redis(
            host=HOST,
            port=self.port,
            db=db,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            retry=Retry(NoBackoff(), 0),
        )

    # -- life cycle ----------------------------------------------------------------
    def start(self) -> Self:
        if self._proc is not None:
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
        try:
            for attempt in range(5):  # free_port() races with other programs
                self._port = free_port()
                try:
                    self._spawn_and_wait()
                    return self
                except EmbeddedStackError as exc:
                    if attempt == 4 or "Address already in use" not in str(exc):
                        raise
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable")

    def _command(self) -> list[str]:
        return [
            self.executable,
            "--port", str(self.port),
            "--bind", HOST,
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "no",
            "--maxmemory-policy", "noeviction",
            "--dir", str(self.workdir),
            "--logfile", str(self.log_path),
        ]  # fmt: skip

    def _spawn_and_wait(self) -> None:
        self._log = open(self.workdir / "redis.stdio.log", "ab")  # noqa: SIM115
        self._proc = procs.spawn(self._command(), stdout=self._log)
        client = self.client()
        deadline = time.monotonic() + self.startup_timeout
        try:
            while True:
                if procs.exited(self._proc):
                    tail = self._log_tail()
                    self._reap()
                    raise EmbeddedStackError(f"redis-server exited during start-up:\n{tail}")
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        return
                if time.monotonic() >= deadline:
                    self._reap()
                    raise EmbeddedStackError(
                        f"redis-server did not answer PING within {self.startup_timeout:g}s"
                    )
                time.sleep(0.01)
        finally:
            client.close()

    def _log_tail(self, lines: int = 20) -> str:
        text = ""
        for path in (self.log_path, self.workdir / "redis.stdio.log"):
            with contextlib.suppress(OSError):
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _reap(self) -> None:
        if self._proc is not None:
            procs.finish(self._proc)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop redis-server (SIGTERM, SIGKILL after `timeout`) and delete the directory."""
        if self._proc is not None:
            procs.stop([self._proc], timeout=timeout)
            self._proc = None
        self._reap()
        if self._dir is not None and not self.keep and self._given_dir is None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

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
        where = f" at {self.lock_url}" if self._port is not None and self.running else ""
        return f"<EmbeddedStack{where}>"
