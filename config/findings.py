"""What a start-up check finds (a refusal or a warning), and what lock backends' checks are told.

Here, at the bottom layer, so that each lock backend keeps its start-up checks in its own
module (`LockBackend.startup_findings`) without importing the worker package, which runs
them (worker/checks.py re-exports these names).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

LOCK_SERVER_DOWN = "lock-server-down"


@dataclass(frozen=True)
class Finding:
    """One problem found at start-up; `refuse` ones stop the process."""

    refuse: bool
    setting: str
    problem: str
    fix: str
    code: str = ""  # a stable name for findings the start-up acts on (LOCK_SERVER_DOWN)

    def __str__(self) -> str:
        return f"{self.setting}: {self.problem}. Fix: {self.fix}"


def refuse(setting: str, problem: str, fix: str) -> Finding:
    return Finding(True, setting, problem, fix)


def warn(setting: str, problem: str, fix: str) -> Finding:
    return Finding(False, setting, problem, fix)


@dataclass(frozen=True)
class LockTarget:
    """What a lock backend's start-up checks are told: the variable that names its URL, the
    URL, the socket timeout of the settings, and every lease TTL the app asks for."""

    setting: str
    url: str
    socket_timeout: float
    ttls: tuple[float, ...] = ()


class OutageProbe(Protocol):
    """A fresh connection to a lock server that was down at start-up: whether it answers
    now, and then its start-up checks (`LockBackend.outage_probe`)."""

    def answers(self) -> bool: ...

    def findings(self) -> Iterator[Finding]: ...

    def close(self) -> None: ...
