"""A holder in a child process, frozen by SIGSTOP while a newer holder writes, then let go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Frozen:
    """The child: `fence` is the one it holds; `thaw()` lets it write late, and says what it
    printed ("REFUSED" or "WROTE")."""

    proc: subprocess.Popen[str]
    fence: int

    def thaw(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.write("\n")  # the child waits on stdin: now it writes with its fence
        self.proc.stdin.flush()
        verdict = self.proc.stdout.readline().strip()
        self.proc.wait(30)
        return verdict


@contextmanager
def frozen_holder(script: str, *args: str) -> Iterator[Frozen]:
    """Run `script` (`python -c`), which prints `HELD <fence>` once it holds the lease, then
    reads a line from stdin before its fenced write; SIGSTOP it there. Always reaped."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("HELD"), line
        os.kill(proc.pid, signal.SIGSTOP)
        yield Frozen(proc, int(line.split()[1]))
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
