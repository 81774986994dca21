"""The root of every jobfence exception, shared by all packages."""

from __future__ import annotations

from collections.abc import Sequence

EX_CONFIG = 78  # sysexits.h: a configuration error; a refused start, and `jobfence check`'s refusal


class JobfenceError(Exception):
    """Root of all jobfence errors; catch this to catch them all."""


class UnsafeSettings(JobfenceError, ValueError):
    """Settings that are invalid or would break the safety argument; raised at start-up.

    The message names the variable, the problem and the fix, and never holds a setting's
    value that could be secret (key secret, URL passwords). `also` lists further problems
    found at the same time.
    """

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        self.also: tuple[UnsafeSettings, ...] = ()
        super().__init__(f"{field}: {problem}. Fix: {fix}")

    def with_also(self, others: Sequence[UnsafeSettings]) -> UnsafeSettings:
        """This error, its message followed by one line per other problem."""
        self.also = tuple(others)
        self.args = ("\n".join([self.args[0], *(f"  also {o.args[0]}" for o in others)]),)
        return self


class InsecureSettings(UnsafeSettings):
    """A security downgrade JOBFENCE_ALLOW_INSECURE does not name, refused before any
    connection to the lock server (so no password crosses a clear-text channel)."""


#: The fix for a setting jobfence does not know: the reference lists every one.
SETTINGS_FIX = "remove it (every setting: docs/reference/settings.md)"
