"""Who a process is, beyond its pid: whether it lives, its boot, pid namespace and start time."""

from __future__ import annotations

import os
from functools import cache


@cache
def namespace() -> str:
    """`boot id/pid namespace` of this process (Linux); empty where /proc does not say.

    Pids are comparable only within one boot and one pid namespace: a container on the
    same host with the same host name numbers its processes apart.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{ns.removeprefix('pid:[').removesuffix(']')}"


def process_start(pid: int) -> str:
    """`boot id/pid namespace/start time in clock ticks` of `pid`; empty if unknown or gone.

    Two processes with the same pid in one boot never share a start time, so a lock that
    recorded this at grant can tell its owner from a later process that reused the pid.
    """
    where = namespace()
    if not where or pid <= 0:
        return ""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        # Fields after the command name (which may hold spaces and parentheses);
        # the start time is field 22 of the whole line, so the 20th after it.
        return f"{where}/{stat.rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return ""


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
