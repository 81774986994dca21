"""Child processes this program started: spawn each in its own session, signal, stop and reap."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

# Re-exported: the launchers and their tests ask them here.
from jobfence.locks.procinfo import pid_alive as pid_alive
from jobfence.locks.procinfo import proc_state as proc_state

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A preexec hook that has the kernel send `sig` to the child when this process dies
    (even by SIGKILL), so no child outlives the program that started it. Linux only."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None  # the signal follows the forking thread: only the main one lives on
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:  # runs in the child between fork and exec: no imports, no locks
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


def tail(path: str | os.PathLike[str], lines: int = 40) -> str:
    """The last `lines` lines of a (log) file, or why it cannot be read."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


# -- our own children ----------------------------------------------------------------


def spawn(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: IO[Any] | int | None = None,
    cwd: str | os.PathLike[str] | None = None,
    **popen: Any,
) -> subprocess.Popen[bytes]:
    """Start `args` as the leader of a new session: a terminal's Ctrl-C does not reach it,
    and its own children (a prefork pool) share its process group, so they can be stopped
    together. If this process dies without stopping it, it gets SIGTERM (Linux; only when
    spawned from the main thread, as the kernel ties the signal to the forking thread).
    `popen` adds Popen options (`user`, `group`: a server that refuses to run as root)."""
    return subprocess.Popen(
        list(args),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_parent_death_signal(signal.SIGTERM),
        **popen,
    )


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Signal the process group `proc` leads. Safe until `proc` is reaped: an unreaped
    leader keeps its pid and pgid from being reused. A vanished target is fine."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def signal_leader(proc: subprocess.Popen[Any], sig: int) -> None:
    """Signal `proc` alone (not its pool children), while it is unreaped."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(proc.pid, sig)


def signal_process(proc: subprocess.Popen[Any], sig: int, *, group: bool) -> None:
    """`signal_group` with `group`, else `signal_leader`: never once `proc` is reaped."""
    if group:
        signal_group(proc, sig)
    else:
        signal_leader(proc, sig)


def exit_status(proc: subprocess.Popen[Any]) -> int | None:
    """`proc`'s exit code (-n: killed by signal n), None while it runs; read WITHOUT reaping
    it, so its pid and pgid stay ours."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere (maybe by a thread still inside wait())
        code = proc.poll()
        return 0 if code is None else code
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def exited(proc: subprocess.Popen[Any]) -> bool:
    """True once `proc` has exited, checked WITHOUT reaping it (its pgid stays ours)."""
    return exit_status(proc) is not None


def wait_exited(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Poll `exited` (without reaping) until `timeout`; True if it exited."""
    deadline = time.monotonic() + timeout
    while not exited(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def finish(proc: subprocess.Popen[Any], timeout: float | None = None) -> int:
    """SIGKILL whatever is left of `proc` and its group (orphaned pool children), then reap
    `proc` (subprocess.TimeoutExpired after `timeout`); returns its exit code."""
    signal_group(proc, signal.SIGKILL)  # a no-op unless `proc` leads a group
    signal_leader(proc, signal.SIGKILL)
    return proc.wait(timeout)


def stop(
    procs: Sequence[subprocess.Popen[Any]],
    *,
    sig: int = signal.SIGTERM,
    timeout: float = 10.0,
    group: bool = False,
) -> list[int]:
    """Ask every process (with `group`, every process group) to stop with `sig`, after a
    SIGCONT as a stopped process cannot act on it; SIGKILL each group after `timeout`; reap
    all. Returns the exit codes."""
    for proc in procs:
        signal_process(proc, signal.SIGCONT, group=group)
        signal_process(proc, sig, group=group)
    deadline = time.monotonic() + timeout
    for proc in procs:
        wait_exited(proc, max(0.0, deadline - time.monotonic()))
    return [finish(proc) for proc in procs]


# -- the launchers' base: a server we start, wait for, and stop by pid ----------------


class Launcher:
    """A launcher used as a context manager: `with X() as x` starts it (stopping whatever
    started if the start fails) and stops it on the way out."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


#: What a server's log says when a port chosen free a moment before was taken meanwhile.
PORT_TAKEN = "Address already in use"


class ServerGroup(Launcher):
    """Several launchers in one directory started as one: a failed start stops those that
    started; `stop` stops every member (best effort) and removes the directory.

    Ports passed in a member's arguments (a cluster bus, a TLS port) are chosen free a
    moment before use, and another process (a client's ephemeral port) may take one first:
    a group whose `_replan` chooses them afresh then starts again on the new ones."""

    servers: Sequence[Launcher]
    _dir: Workdir
    start_attempts = 5

    def start(self) -> Self:
        for attempt in range(self.start_attempts):
            try:
                for server in self.servers:
                    server.start()
                self._formed()
                return self
            except BaseException as exc:
                self._stop_members()
                if not (attempt + 1 < self.start_attempts and PORT_TAKEN in str(exc)
                        and self._replan()):  # fmt: skip
                    self._dir.remove()
                    raise
        raise AssertionError("unreachable")

    def _formed(self) -> None:
        """Runs once every member has started (a cluster joins its nodes here)."""

    def _replan(self) -> bool:
        """Describe every member afresh, on new ports; False where a group cannot."""
        return False

    def _stop_members(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()

    def stop(self) -> None:
        self._stop_members()
        self._dir.remove()


class Workdir:
    """A launcher's directory: the one given (created, kept) or a temporary one that
    `remove()` deletes, as does a finalizer if the launcher is dropped without stopping."""

    def __init__(
        self, given: str | os.PathLike[str] | None, prefix: str, *, parent: str | None = None
    ) -> None:
        self.given = Path(given) if given is not None else None
        self.prefix = prefix
        self.parent = parent
        self._path: str | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def made(self) -> bool:
        return self._path is not None

    @property
    def path(self) -> Path:
        if self._path is None:
            raise RuntimeError(f"{self.prefix.strip('-')}: not started yet")
        return Path(self._path)

    def make(self) -> Path:
        """The directory, made now if it is not there yet."""
        if self._path is None:
            if self.given is not None:
                self.given.mkdir(parents=True, exist_ok=True)
                self._path = str(self.given)
            else:
                self._path = tempfile.mkdtemp(prefix=self.prefix, dir=self.parent)
                self._finalizer = weakref.finalize(self, shutil.rmtree, self._path, True)
        return Path(self._path)

    def remove(self) -> None:
        """Delete the directory if it is a temporary one of ours; a given one is kept."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._path = None


def _finish_quietly(proc: subprocess.Popen[bytes]) -> None:
    """The finalizer's last resort: never leave a server we started behind."""
    with contextlib.suppress(Exception):
        finish(proc, timeout=5)


class ServerProcess:
    """One server child process: spawned in its own session with its output appended to a
    log file, waited on until `ready()` answers, paused, killed or stopped by its pid and
    reaped. A finalizer kills it if the launcher is dropped without stopping it; nothing is
    ever signalled by name, and nothing after it has been reaped.

    `error` is the exception type the launcher raises (its name tells the user which server
    failed); `what` names the server in messages, e.g. ``redis-server on port 6380``.
    """

    def __init__(self, what: str, *, error: type[Exception] = RuntimeError) -> None:
        self.what = what
        self.error = error
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.paused = False
        self._log: IO[bytes] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def running(self) -> bool:
        """True while the process lives (checked without reaping it), even when paused."""
        return self.proc is not None and not exited(self.proc)

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.what} is not running")
        return self.proc.pid

    def tail(self, lines: int = 40) -> str:
        return "<not started>" if self.log_path is None else tail(self.log_path, lines)

    def spawn(
        self,
        args: Sequence[str],
        *,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        **popen: Any,
    ) -> subprocess.Popen[bytes]:
        """Start `args` (its stdout and stderr appended to `log_path`); reaps a predecessor
        that died on its own first."""
        if self.proc is not None:
            self.kill()
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed by _forget
        try:
            self.proc = spawn(args, stdout=self._log, env=env, cwd=cwd, **popen)
        except OSError as exc:
            self._forget()
            raise self.error(f"cannot run {args[0]!r}: {exc}") from exc
        self.paused = False
        self._finalizer = weakref.finalize(self, _finish_quietly, self.proc)
        return self.proc

    def wait_ready(
        self, ready: Callable[[], bool], timeout: float, *, interval: float = 0.01
    ) -> None:
        """Poll `ready` until it is true; if the process exits first, or `timeout` passes,
        kill and reap it and raise `error` with the end of its log."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.proc
            if proc is None or exited(proc):
                code = finish(proc) if proc is not None else None
                log = self.tail(30)
                self._forget()
                raise self.error(f"{self.what} exited with code {code} during start-up\n{log}")
            if ready():
                return
            if time.monotonic() >= deadline:
                log = self.tail(30)
                self.kill()
                raise self.error(f"{self.what} not ready within {timeout:.1f}s\n{log}")
            time.sleep(interval)

    def send(self, sig: int) -> None:
        """Send `sig` to the server alone (not its process group) while it is ours."""
        if not self.running:
            raise RuntimeError(f"{self.what} is not running")
        assert self.proc is not None
        signal_leader(self.proc, sig)

    def pause(self) -> None:
        """SIGSTOP: its connections stay open, nothing is answered."""
        self.send(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.send(signal.SIGCONT)
        self.paused = False

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Paused inside the block, resumed on the way out (even on error)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def kill(self, *, group: bool = True) -> int | None:
        """SIGKILL the server and its group (a crash) and reap it; its exit code. Without
        `group` the server alone: its children are left to notice (PostgreSQL's backends)."""
        if self.proc is None:
            return None
        try:
            if not group:
                signal_leader(self.proc, signal.SIGKILL)
                return self.proc.wait(30)
            return finish(self.proc, timeout=30)
        finally:
            self._forget()

    def stop(self, timeout: float = 10.0, *, sig: int = signal.SIGTERM) -> int | None:
        """`sig` (after a SIGCONT), SIGKILL after `timeout`, reap; idempotent."""
        if self.proc is None:
            return None
        try:
            return stop([self.proc], sig=sig, timeout=timeout)[0]
        finally:
            self._forget()

    def _forget(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None
        self.paused = False


class SingleServer(Launcher):
    """A launcher of one server process in one directory (redis-server, ZooKeeper): what it
    answers about that process, and pause, resume and kill, come from here."""

    _server: ServerProcess
    _dir: Workdir

    @property
    def pid(self) -> int:
        return self._server.pid

    @property
    def running(self) -> bool:
        """True while the process lives (checked without reaping it), even when paused."""
        return self._server.running

    @property
    def paused(self) -> bool:
        return self._server.paused

    @property
    def workdir(self) -> Path:
        return self._dir.path

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing is answered."""
        self._server.pause()

    def resume(self) -> None:
        """SIGCONT a paused server."""
        self._server.resume()

    def suspended(self) -> contextlib.AbstractContextManager[None]:
        """Context manager: paused inside the block, resumed on exit (even on error)."""
        return self._server.suspended()

    def kill(self) -> None:
        """SIGKILL the server (a crash) and reap it; its directory and port are kept."""
        self._server.kill()
