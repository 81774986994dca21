"""The checks every store makes before its round trip (a key, a TTL, seconds, a grant, a swap,
a commit, a rate), and the holder a grant names by default: this host and process."""

from __future__ import annotations

import math
import os
import re
import socket

from jobfence.locks.errors import LockError
from jobfence.locks.lease import Lease, OwnerMeta
from jobfence.locks.procinfo import process_start
from jobfence.locks.replies import CommitRecord

MAX_KEY_LENGTH = 512


_process_meta: OwnerMeta | None = None  # this process's host and pid, built on first use


def _forget_process_meta() -> None:
    global _process_meta
    _process_meta = None


os.register_at_fork(after_in_child=_forget_process_meta)  # a forked child has its own pid


def default_meta(task_id: str = "", task_name: str = "") -> OwnerMeta:
    """This host and process (cached per process), with the given task id and name.

    The process's start time goes with its pid, so the orphan finder can tell this
    process from a later one that reused the pid.
    """
    global _process_meta
    meta = _process_meta
    if meta is None:
        pid = os.getpid()
        meta = _process_meta = OwnerMeta(
            host=socket.gethostname(), pid=pid, process_start=process_start(pid)
        )
    if not task_id and not task_name:
        return meta
    # Filled directly: the frozen dataclass's __init__ (one object.__setattr__ per field)
    # costs twice as much, and dataclasses.replace more, once per job.
    made = object.__new__(OwnerMeta)
    fields = made.__dict__
    fields.update(meta.__dict__)
    fields["task_id"] = task_id
    fields["task_name"] = task_name
    return made


_BAD_KEY_CHARS = re.compile(r"[{}*?\[\]\n]")


def validate_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise LockError(f"lock key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise LockError(f"lock key longer than {MAX_KEY_LENGTH} characters; hash it first")
    if _BAD_KEY_CHARS.search(key):
        raise LockError(f"lock key {key!r} contains one of '{{}}*?[]' or a newline; hash it first")


def validate_seconds(
    value: object, name: str, *, positive: bool = False, forever: bool = False
) -> float:
    """`value` as seconds: a number, >= 0 (> 0 if `positive`) and finite (+inf too if
    `forever`, "wait for ever"); else LockError naming `name`. NaN passes every `<` test."""
    sign = "positive" if positive else "non-negative"
    if not isinstance(value, int | float):
        raise LockError(f"{name} must be a {sign} number of seconds, got {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or (math.isinf(seconds) and not (forever and seconds > 0)):
        fix = "pass None to wait for ever" if forever else "pass a number of seconds, e.g. 30"
        raise LockError(f"{name} must be a finite number of seconds, got {value!r}; {fix}")
    if seconds < 0 or (positive and seconds == 0):
        raise LockError(f"{name} must be a {sign} number of seconds, got {value!r}")
    return seconds


_NUMBERS = (float, int)  # exactly: a bool or a number type of its own takes the checks


def validate_ttl(ttl: float) -> int:
    """Return the TTL in whole milliseconds, refusing anything below 1 ms (and NaN, infinity)."""
    if type(ttl) in _NUMBERS and 0.001 <= ttl < math.inf:  # a job's TTLs: nothing to word
        return int(ttl * 1000)
    validate_seconds(ttl, "ttl", positive=True)
    ms = int(ttl * 1000)
    if ms < 1:
        raise LockError(f"ttl must be at least 0.001 seconds, got {ttl!r}")
    return ms



def grant_args(key: str, ttl: float, meta: OwnerMeta | None) -> tuple[int, OwnerMeta]:
    """Refuse a bad key or TTL of a grant; (TTL in ms, the holder's meta or this process's)."""
    validate_key(key)
    return validate_ttl(ttl), meta or default_meta()


def check_swap(key: str, expect: str, new: str | None, ttl: float) -> int:
    """Refuse a bad swap_publish (see LockBackend.swap_publish); its TTL in ms."""
    validate_key(key)
    if not expect or new == "":
        raise LockError("swap_publish needs a non-empty expect, and new non-empty or None",
                        key=key)  # fmt: skip
    return validate_ttl(ttl)


def commit_record(
    lease: Lease, state: str, result: str, fingerprint: str, result_ttl: float
) -> CommitRecord:
    """Refuse a bad commit (a state not DONE or FAILED, a bad result TTL); what it writes."""
    if state not in ("DONE", "FAILED"):
        raise LockError(f"commit state must be DONE or FAILED, got {state!r}", key=lease.key)
    return CommitRecord(lease.key, lease.owner, lease.fence, state, result, fingerprint,
                        validate_ttl(result_ttl))  # fmt: skip


def validate_rate(key: str, interval: float, burst: int) -> None:
    if not interval > 0 or not isinstance(burst, int) or burst < 1:
        raise LockError(
            f"rate needs interval > 0 and burst >= 1, got {interval!r}, {burst!r}", key=key
        )
