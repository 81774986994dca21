"""A private, non-persistent redis-server on 127.0.0.1, started, stopped and reaped by us."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from jobfence.worker import procs

__all__ = ["HOST", "RedisServer", "RedisServerError", "free_port"]

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """Return a TCP port that was free on ``host`` a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _kill_and_reap(proc: subprocess.Popen[bytes], workdir: str | None) -> None:
    """Last-resort cleanup used by the finalizer: never leave a redis-server behind."""
    with contextlib.suppress(Exception):
        procs.finish(proc, timeout=5)
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
    ``restart()`` comes back on the same port (with an empty data set). Its files (log,
    stdout/stderr) go to ``workdir`` if given (kept), else to a temporary directory that
    ``stop()`` deletes.

    For fault tests: ``bind`` lists the addresses it listens on (the first is the one its
    clients and ``url`` use; others, such as a veth address, serve ``url_for``);
    ``prefix_command`` runs it under a wrapper (``ip netns exec NAME``, say) and ``env``
    adds variables to its environment (``LD_PRELOAD`` of a clock faker, say).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        executable: str = "redis-server",
        extra_args: Sequence[str] = (),
        startup_timeout: float = 10.0,
        workdir: str | os.PathLike[str] | None = None,
        bind: Sequence[str] = (HOST,),
        prefix_command: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not bind:
            raise ValueError("bind must list at least one address, e.g. ('127.0.0.1',)")
        self._port: int | None = port
        self._bind = tuple(bind)
        self._prefix_command = tuple(prefix_command)
        self._env = dict(env) if env is not None else None
        self._executable = executable
        self._extra_args = tuple(extra_args)
        self._startup_timeout = startup_timeout
        self._given_workdir = Path(workdir) if workdir is not None else None
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
        """The address clients of this object connect to: the first of ``bind``."""
        return self._bind[0]

    def db_url(self, db: int) -> str:
        """``redis://`` URL of database ``db`` of this server."""
        return self.url_for(self.host, db)

    def url_for(self, host: str, db: int = 0) -> str:
        """``redis://`` URL of database ``db`` through ``host``, one of the bound addresses."""
        if host not in self._bind:
            raise ValueError(f"host {host!r} is not one of the bound addresses {self._bind}")
        return f"redis://{host}:{self.port}/{db}"

    @property
    def url(self) -> str:
        return self.db_url(0)

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
    def stdio_path(self) -> Path:
        return self.workdir / "stdio.log"

    @property
    def running(self) -> bool:
        """True while the process lives (checked without reaping it), even when paused."""
        return self._proc is not None and not procs.exited(self._proc)

    @property
    def paused(self) -> bool:
        return self._paused

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log and of its stdout/stderr."""
        if self._workdir is None:
            return "<not started>"
        return (
            f"--- {self.log_path} ---\n{procs.tail(self.log_path, lines)}\n"
            f"--- stdout/stderr ---\n{procs.tail(self.stdio_path, lines)}"
        )

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> Self:
        """Start the server and wait until it answers PING; idempotent while running.

        The first start picks a free port (retrying if another process grabs it first);
        later starts reuse that port.
        """
        if self.running:
            return self
        if self._proc is not None:  # it died on its own: reap it before replacing it
            _kill_and_reap(self._proc, None)
            self._forget_process()
        if self._workdir is None:
            if self._given_workdir is not None:
                self._given_workdir.mkdir(parents=True, exist_ok=True)
                self._workdir = str(self._given_workdir)
            else:
                self._workdir = tempfile.mkdtemp(prefix="jobfence-redis-")
        choose_port = self._port is None
        attempts = 5 if choose_port else 1
        for attempt in range(attempts):
            if choose_port:
                self._port = free_port(self.host)
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
            *self._prefix_command,
            self._executable,
            "--port", str(self._port),
            "--bind", *self._bind,
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._workdir,
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.log_path),
            "--loglevel", "notice",
            # Protected mode refuses clients from any address but loopback; a server bound
            # to another address (a test's private veth link) is meant to serve them.
            *(["--protected-mode", "no"] if self._bind != (HOST,) else []),
            *self._extra_args,
        ]  # fmt: skip

    def _spawn_and_wait(self) -> None:
        assert self._workdir is not None
        self._stdio = open(self.stdio_path, "ab")  # noqa: SIM115
        try:
            # A new session: Ctrl-C in the terminal must not hit the server first.
            env = {**os.environ, **self._env} if self._env is not None else None
            proc = procs.spawn(self._command(), stdout=self._stdio, env=env)
        except OSError as exc:
            self._close_stdio()
            raise RedisServerError(f"cannot run {self._executable!r}: {exc}") from exc
        self._proc = proc
        self._paused = False
        if self._finalizer is not None:
            self._finalizer.detach()
        owned_dir = self._workdir if self._given_workdir is None else None
        self._finalizer = weakref.finalize(self, _kill_and_reap, proc, owned_dir)

        probe = redis.Redis(
            host=self.host,
            port=self.port,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        deadline = time.monotonic() + self._startup_timeout
        try:
            while True:
                if procs.exited(proc):
                    code = procs.finish(proc)
                    self._forget_process()
                    raise RedisServerError(
                        f"redis-server on port {self._port} exited with code "
                        f"{code} during start-up\n{self.log_tail()}"
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
            procs.stop([self._proc], timeout=timeout)  # resumes a paused server first
            self._forget_process()
        if self._workdir is not None:
            if self._given_workdir is None:
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

    def _signal(self, sig: int) -> None:
        if not self.running:
            raise RuntimeError("RedisServer is not running")
        assert self._proc is not None
        procs.signal_leader(self._proc, sig)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing is answered."""
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT a paused server."""
        self._signal(signal.SIGCONT)
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
        """A ``redis.Redis`` to this server (db 0 unless ``db=`` says otherwise); closed by
        ``stop()`` at the latest.

        Keyword arguments are passed through (e.g. ``socket_timeout=0.2``,
        ``decode_responses=True``). Unlike redis-py's default (3 retries with exponential
        backoff, which turns a 0.2 s timeout into several seconds), each command is tried
        once unless a ``retry`` is given.
        """
        options: dict[str, Any] = {
            "db": 0,
            "socket_connect_timeout": 2.0,
            "socket_timeout": 5.0,
            "retry": Retry(NoBackoff(), 0),
        }
        options.update(kwargs)
        client = redis.Redis(host=self.host, port=self.port, **options)
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
        return f"<RedisServer {self.host}:{self._port} {state}>"
