"""The root of every jobfence exception, shared by all packages."""

from __future__ import annotations


class JobfenceError(Exception):
    """Root of all jobfence errors; catch this to catch them all."""


class UnsafeSettings(JobfenceError, ValueError):
    """Settings that would break the safety argument; raised at start-up."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")
