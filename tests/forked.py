"""Run a function in a forked child of the test process; a child that hangs is killed."""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Callable

from tests.servers import wait_for

#: Seconds a forked child may take, on a loaded box, for what takes it milliseconds.
CHILD_DEADLINE = 30.0


def run_in_child(body: Callable[[], None], deadline: float = CHILD_DEADLINE) -> int | None:
    """`body()` in a forked child: its exit status, or None if it hung (see `wait_child`)."""
    return wait_child(start_child(body), deadline)


def start_child(body: Callable[[], None]) -> int:
    """Fork; the child runs `body()` and exits 0 (1 if it raised, its traceback on stderr),
    never returning into pytest. Returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait_child(pid: int, deadline: float = CHILD_DEADLINE) -> int | None:
    """`pid`'s exit status, or None if it has not exited within `deadline` seconds (then it
    is SIGKILLed, by its pid, and reaped)."""
    status: list[int] = []

    def exited() -> bool:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(os.waitstatus_to_exitcode(code))
        return bool(done)

    try:
        wait_for(exited, timeout=deadline, interval=0.02)
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    return status[0]
