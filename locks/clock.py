"""Injectable clocks, so lease deadlines can be tested without patching `time`."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    # The builtin itself: a read costs no Python frame (each step of a job reads it).
    monotonic = staticmethod(time.monotonic)

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that only moves when told to; `sleep` advances it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def advance(self, seconds: float) -> None:
        self.now += seconds


SYSTEM_CLOCK = SystemClock()
