"""Child processes this program started: spawn each in its own session, stop it and its group."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

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


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (Linux /proc; falls back to kill 0)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def spawn(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: IO[Any] | int | None = None,
    cwd: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start `args` as the leader of a new session: a terminal's Ctrl-C does not reach it,
    and its own children (a prefork pool) share its process group, so they can be stopped
    together. If this process dies without stopping it, it gets SIGTERM (Linux; only when
    spawned from the main thread, as the kernel ties the signal to the forking thread)."""
    return subprocess.Popen(
        list(args),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_parent_death_signal(signal.SIGTERM),
    )


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Signal the process group `proc` leads. Safe until `proc` is reaped: an unreaped
    leader keeps its pid and pgid from being reused."""
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


def exited(proc: subprocess.Popen[Any]) -> bool:
    """True once `proc` has exited, checked WITHOUT reaping it (its pgid stays ours)."""
    if proc.returncode is not None:
        return True
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        proc.poll()
        return True
    return info is not None


def wait_exited(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Poll `exited` until `timeout`; True if it exited."""
    deadline = time.monotonic() + timeout
    while not exited(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def finish(proc: subprocess.Popen[Any]) -> int:
    """Kill whatever is left of `proc`'s group (orphaned pool children), then reap `proc`."""
    signal_group(proc, signal.SIGKILL)
    return proc.wait()


def stop(
    procs: Sequence[subprocess.Popen[Any]], *, sig: int = signal.SIGTERM, timeout: float = 10.0
) -> list[int]:
    """Ask every process to stop with `sig`, SIGKILL each group after `timeout`, reap all."""
    for proc in procs:
        signal_leader(proc, signal.SIGCONT)  # a stopped process cannot act on `sig`
        signal_leader(proc, sig)
    deadline = time.monotonic() + timeout
    for proc in procs:
        wait_exited(proc, max(0.0, deadline - time.monotonic()))
    return [finish(proc) for proc in procs]
