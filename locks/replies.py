"""What a lock store answers and writes: a held lock's info, Busy, a job record, the record a
commit writes, a rate grant, and the server's health and security."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from jobfence.locks.lease import Lease


@dataclass(frozen=True)
class Health:
    """One cheap round trip to the lock server: did it answer, how fast, and what it said
    (or why it failed). Never an owner token or a password."""

    ok: bool
    latency: float  # seconds, on this host's clock
    detail: str


@dataclass(frozen=True)
class Security:
    """How the connection to the lock server is protected, as configured (nothing is
    probed): for the start-up check, which warns about a downgrade or a remote server
    reached without authentication. `LockBackend.security()` gives None where unknown."""

    tls: bool  # every connection is encrypted (never a silent fall-back to plain text)
    verified: bool  # the server's certificate chain is checked against a CA
    hostname_checked: bool  # ... and must name the host connected to
    auth: bool  # the client proves who it is: a password, a client certificate, a digest


@dataclass(frozen=True)
class LockInfo:
    """What `inspect` reports of a held lock. The owner token is never included."""

    key: str
    fence: int
    ttl_left: float
    host: str
    pid: int
    task_id: str
    task_name: str
    acquired_at: float  # server wall clock, seconds since the epoch
    last_heartbeat: float  # server wall clock, seconds since the epoch
    process_start: str = ""  # the holder's boot id and start time (locks.procinfo), if known


@dataclass(frozen=True)
class Busy:
    """The key is held by someone else; it expires in `ttl_left` seconds at the latest."""

    ttl_left: float
    task_id: str = ""  # the holder's task id, so a task can tell its own earlier attempt
    fingerprint: str = ""  # the holder's argument fingerprint (job grants), to spot a conflict


@dataclass(frozen=True)
class JobRecord:
    """A job's completion record: state DONE or FAILED, with result and argument fingerprint."""

    state: str
    fingerprint: str
    result: str  # JSON text
    fence: int
    finished_at: float


BeginResult = Lease | Busy | JobRecord


class CommitRecord(NamedTuple):
    """What a commit writes: the job's record, under the lease's owner check (a backend's
    `_commit` unpacks it; the result TTL in milliseconds)."""

    key: str
    owner: str
    fence: int
    state: str  # DONE or FAILED
    result: str  # JSON text
    fingerprint: str
    result_ttl_ms: int


class RateGrant(NamedTuple):
    """One answer of `take_rate`. `admitted`: the event may happen `wait` seconds from now
    (0: at once; a slot was reserved for it). Refused: `wait` is how long until one would
    be admitted at once; nothing was reserved. `now`: the server clock, in seconds."""

    admitted: bool
    wait: float
    now: float
