"""A private, non-persistent redis-server on 127.0.0.1, started, stopped and reaped by us."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from devstack import procs
from jobfence.config.schemes import backend_schemes

__all__ = ["HOST", "RedisServer", "RedisServerError", "free_port"]

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """Return a TCP port that was free on ``host`` a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class RedisServerError(RuntimeError):
    """A private redis-server could not be started."""


def _answers(probe: redis.Redis) -> bool:
    try:
        return bool(probe.ping())
    except redis.RedisError:
        return False


class RedisServer(procs.SingleServer):
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
        password: str | None = None,
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
        self._dir = procs.Workdir(workdir, "jobfence-redis-")
        self._server = procs.ServerProcess("redis-server", error=RedisServerError)
        self._clients: list[redis.Redis] = []
        #: requirepass (and masterauth, for a replica); the probe and `client()` log in with it
        self.password = password

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
        return f"{backend_schemes('redis').plain}://{host}:{self.port}/{db}"

    @property
    def url(self) -> str:
        return self.db_url(0)

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

    @property
    def stdio_path(self) -> Path:
        return self.workdir / "stdio.log"

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log and of its stdout/stderr."""
        if not self._dir.made:
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
        self._dir.make()
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
        assert self._port is not None
        return [
            *self._prefix_command,
            self._executable,
            "--port", str(self._port),
            "--bind", *self._bind,
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.log_path),
            "--loglevel", "notice",
            # Protected mode refuses clients from any address but loopback; a server bound
            # to another address (a test's private veth link) is meant to serve them.
            *(["--protected-mode", "no"] if self._bind != (HOST,) else []),
            *(["--requirepass", self.password, "--masterauth", self.password]
              if self.password else []),
            *self._extra_args,
        ]  # fmt: skip

    def _spawn_and_wait(self) -> None:
        self._server.what = f"redis-server on port {self._port}"
        # A new session: Ctrl-C in the terminal must not hit the server first.
        env = {**os.environ, **self._env} if self._env is not None else None
        self._server.spawn(self._command(), log_path=self.stdio_path, env=env)
        probe = redis.Redis(
            host=self.host,
            port=self.port,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
            password=self.password,
        )
        try:
            self._server.wait_ready(lambda: _answers(probe), self._startup_timeout)
        except RedisServerError as exc:  # the server's own log says why (a port in use)
            raise RedisServerError(f"{exc}\n{procs.tail(self.log_path)}") from None
        finally:
            probe.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, SIGKILL after ``timeout``), reap, delete the temp dir."""
        self._close_clients()
        self._server.stop(timeout)  # resumes a paused server first
        self._dir.remove()

    def restart(self) -> Self:
        """Kill the server and start a new one on the same port; all data is lost."""
        self.kill()
        return self.start()

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
            "password": self.password,
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

    def __repr__(self) -> str:
        state = "paused" if self.paused else ("running" if self.running else "stopped")
        return f"<RedisServer {self.host}:{self._port} {state}>"
