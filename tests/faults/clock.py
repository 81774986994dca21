"""A redis-server whose wall clock the test steps forward and back while it runs (libfaketime).

    clock = ServerClock(tmp_path / "faketime.rc")
    with RedisServer(env=clock.env()) as server:
        clock.step(+3600)      # the server's TIME, key expiries, ... jump an hour ahead
        clock.set_offset(-60)  # ... and now a minute behind the real clock

libfaketime reads the offset from ``FAKETIME_TIMESTAMP_FILE`` on every call
(``FAKETIME_NO_CACHE=1``); only the wall clock moves (``FAKETIME_DONT_FAKE_MONOTONIC=1``),
as an NTP step or an operator's ``date -s`` would. Debian's redis-server uses jemalloc,
which deadlocks with libfaketime at start-up (libfaketime issue 130), so a small bootstrap
library (``faketime_boot.c``, compiled once with ``cc``) is preloaded first.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BOOT_SOURCE = Path(__file__).with_name("faketime_boot.c")


def libfaketime_path() -> str | None:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    found += sorted(glob.glob("/usr/lib/faketime/libfaketime.so.1"))
    return found[0] if found else None


def unavailable() -> str | None:
    """None if a redis-server can run under libfaketime here, else the reason."""
    if libfaketime_path() is None:
        return "libfaketime not found: install faketime and libfaketime (./.ci/setup does)"
    if shutil.which("cc") is None:
        return "no C compiler (cc) to build the libfaketime bootstrap: install gcc"
    return None


def boot_library() -> str:
    """Path of the compiled bootstrap library, built once per source version."""
    source = BOOT_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / "jobfence-faketime"
    cache.mkdir(exist_ok=True)
    target = cache / f"faketime_boot-{digest}.so"
    if target.exists():
        return str(target)
    tmp = cache / f".{target.name}.{os.getpid()}"
    done = subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-o", str(tmp), str(BOOT_SOURCE), "-ldl"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"cannot build {BOOT_SOURCE.name}: {done.stderr.strip()}")
    os.replace(tmp, target)  # atomic: a concurrent build just replaces it with the same
    return str(target)


class ServerClock:
    """The offset, in whole seconds, of a faked process's wall clock from the real one."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._write()

    @property
    def offset(self) -> int:
        return self._offset

    def set_offset(self, seconds: int) -> None:
        """Step the clock to real time + `seconds` (negative: behind)."""
        if not isinstance(seconds, int):
            raise TypeError(f"offset must be whole seconds (int), got {seconds!r}")
        self._offset = seconds
        self._write()

    def step(self, seconds: int) -> None:
        """Step the clock by `seconds` from where it is now (negative: back)."""
        self.set_offset(self._offset + seconds)

    def _write(self) -> None:
        # Replace, never rewrite in place: the server reads the file on every clock call.
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(f"{self._offset:+d}\n")
        os.replace(tmp, self.path)

    def env(self) -> dict[str, str]:
        """Environment for a process whose wall clock follows this offset."""
        lib = libfaketime_path()
        if lib is None:
            raise RuntimeError(unavailable() or "libfaketime not found")
        return {
            "LD_PRELOAD": f"{boot_library()}:{lib}",
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }
