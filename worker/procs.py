"""Child processes this program started: spawn each in its own session, signal, stop and reap."""

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
from pathlib import Path
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


# -- any process, by pid -------------------------------------------------------------


def _stat_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def proc_state(pid: int) -> str | None:
    """The one-letter state of `pid` in Linux /proc (R, S, T, Z...); None if there is none."""
    try:
        return _stat_state(pid)
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (Linux /proc; falls back to kill 0)."""
    if pid <= 0:
        return False
    try:
        return _stat_state(pid) not in ("Z", "X")
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
