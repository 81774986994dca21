"""Warnings during a lock-server outage, rate-limited: a few lines, then one summary with the count.

One outage makes every job, the keeper and beat warn at once (232 lines in 25 s in a user's
trial). `OUTAGE.warning(log, msg, *args)` writes the first `burst` warnings of each
`window`; the rest are counted, and the first warning after the window (or `flush()`, at
shutdown) writes "lock server unavailable: N warnings suppressed in the last S s".
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable


class WarningLimiter:
    """Rate-limits one kind of warning across every logger that reports it."""

    def __init__(
        self,
        what: str,
        *,
        burst: int = 3,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or not window > 0:
            raise ValueError(f"WarningLimiter needs burst >= 1 and window > 0, got burst={burst} "
                             f"window={window}")  # fmt: skip
        self.what = what
        self.burst = burst
        self.window = window
        self.clock = clock
        self._forked()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (w := ref()) and w._forked())  # type: ignore[func-returns-value]

    def _forked(self) -> None:
        # A forked child starts afresh: a lock a thread of the parent held at the fork (every
        # thread warns at once in an outage) would block its first warning for ever, and the
        # parent's suppressed count is the parent's to report.
        self._lock = threading.Lock()
        self._opened = -float("inf")  # when the current window began
        self._written = 0  # warnings written in it
        self._suppressed = 0  # warnings counted, not written, since the last summary
        self._since = 0.0  # when the first of those came
        self._last_logger: logging.Logger | None = None

    def warning(self, logger: logging.Logger, msg: str, *args: object) -> None:
        """`logger.warning(msg, *args)`, unless this window's burst is spent (then counted)."""
        now = self.clock()
        with self._lock:
            summary = None
            if now - self._opened >= self.window:
                summary = self._take_summary(now)
                self._opened, self._written = now, 0
            write = self._written < self.burst
            if write:
                self._written += 1
            else:
                if not self._suppressed:
                    self._since = now
                self._suppressed += 1
                self._last_logger = logger
        if summary is not None:
            summary[0].warning("%s", summary[1])
        if write:
            logger.warning(msg, *args)

    def flush(self) -> None:
        """Write the summary of what was suppressed, if anything was (at shutdown)."""
        with self._lock:
            summary = self._take_summary(self.clock())
        if summary is not None:
            summary[0].warning("%s", summary[1])

    def reset(self) -> None:
        """Forget the current window and the count, unwritten (each test starts afresh)."""
        with self._lock:
            self._opened, self._written, self._suppressed = -float("inf"), 0, 0
            self._last_logger = None

    @property
    def suppressed(self) -> int:
        return self._suppressed

    def _take_summary(self, now: float) -> tuple[logging.Logger, str] | None:
        if not self._suppressed or self._last_logger is None:
            return None
        text = (f"{self.what}: {self._suppressed} warnings suppressed in the last "
                f"{max(1.0, now - self._since):.0f} s")  # fmt: skip
        logger, self._suppressed, self._last_logger = self._last_logger, 0, None
        return logger, text


#: The lock server's outage warnings, shared by the job lifecycle, the keeper and beat.
OUTAGE = WarningLimiter("lock server unavailable")
