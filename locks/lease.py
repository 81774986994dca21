"""The Lease: one grant of a lock, with its fencing token, deadline and lost flag."""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from jobfence.locks.errors import LeaseLost

if TYPE_CHECKING:
    from jobfence.locks.backend import LockBackend
    from jobfence.locks.clock import Clock

# Extensions are requested ahead of the deadline; a lease counts as lost this
# fraction of its TTL early, to leave room for clock drift between hosts.
DRIFT_FRACTION = 0.01
DRIFT_FLOOR = 0.002


def _new_token_source() -> tuple[bytes, Iterator[int]]:
    return os.urandom(32), itertools.count()


_token_key, _token_count = _new_token_source()


def _reseed_tokens() -> None:
    global _token_key, _token_count
    _token_key, _token_count = _new_token_source()


os.register_at_fork(after_in_child=_reseed_tokens)  # a child never repeats its parent's tokens


def new_owner_token() -> str:
    """128 bits, hex: a keyed BLAKE2b of this process's grant counter under a random key of
    its own (os.urandom at start and after each fork), so unguessable without that key, so
    only the holder can release or extend; unique per grant. No system call per token: one
    os.urandom per grant released the GIL and cost a job ~15 µs beside the keeper's thread."""
    counter = next(_token_count).to_bytes(8, "little")
    return hashlib.blake2b(counter, key=_token_key, digest_size=16).hexdigest()


@dataclass(frozen=True)
class OwnerMeta:
    """What `inspect` may show about a holder. Never the owner token."""

    host: str = ""
    pid: int = 0
    task_id: str = ""
    task_name: str = ""
    process_start: str = ""  # boot id and start time of `pid`: tells a reused pid apart


@dataclass(eq=False)
class Lease:
    """A held lock. `fence` is strictly greater than every earlier grant for `key`."""

    key: str
    owner: str = field(repr=False)
    fence: int
    ttl: float
    deadline: float
    backend: LockBackend = field(repr=False)
    clock: Clock = field(repr=False)
    meta: OwnerMeta = field(default_factory=OwnerMeta, repr=False)
    _lost_cause: BaseException | None = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _on_lost: list[Callable[[Lease, BaseException], None]] = field(default_factory=list, repr=False)

    @classmethod
    def granted(
        cls, backend: LockBackend, key: str, owner: str, fence: int, ttl_ms: int,
        started: float, meta: OwnerMeta, **extra: Any,
    ) -> Self:  # fmt: skip
        """The lease of a grant asked for at `started` (the backend clock's monotonic time):
        its deadline counts from the request, not the reply."""
        ttl = ttl_ms / 1000  # by position: the generated __init__ takes keywords slower
        return cls(key, owner, fence, ttl, started + ttl, backend, backend.clock, meta, **extra)

    # -- state -----------------------------------------------------------------
    @property
    def drift(self) -> float:
        return self.ttl * DRIFT_FRACTION + DRIFT_FLOOR

    def remaining(self) -> float:
        """Seconds until the lease must be considered expired (drift subtracted)."""
        return self.deadline - self.drift - self.clock.monotonic()

    @property
    def lost(self) -> bool:
        return self._lost_cause is not None or self.remaining() <= 0

    @property
    def settled(self) -> bool:
        """Released, or marked lost: what `lost` says without its clock read (the keeper
        checks many leases against one reading of the clock)."""
        return self._released or self._lost_cause is not None

    @property
    def released(self) -> bool:
        return self._released

    @property
    def held(self) -> bool:
        return not self._released and not self.lost

    def check(self) -> None:
        """Raise LeaseLost if the lease was lost, released, or is past its deadline."""
        if self._lost_cause is not None:
            raise LeaseLost("lease lost", key=self.key, fence=self.fence, cause=self._lost_cause)
        if self._released:
            raise LeaseLost("lease already released", key=self.key, fence=self.fence)
        if self.remaining() <= 0:
            raise LeaseLost("lease deadline passed", key=self.key, fence=self.fence)

    # -- transitions -----------------------------------------------------------
    def mark_lost(self, cause: BaseException) -> None:
        """Record the loss once and fire the loss callbacks."""
        with self._lock:
            if self._lost_cause is not None or self._released:
                return
            self._lost_cause = cause
            callbacks = list(self._on_lost)
        for cb in callbacks:
            try:
                cb(self, cause)
            except Exception:  # a broken callback must not hide the loss
                import logging

                logging.getLogger(__name__).exception("lease-lost callback failed key=%s", self.key)

    def on_lost(self, callback: Callable[[Lease, BaseException], None]) -> None:
        self._on_lost.append(callback)

    def renewed(self, started_at: float, ttl: float | None = None) -> None:
        """Move the deadline after a successful extension sent at `started_at`."""
        if ttl is not None:
            self.ttl = ttl
        self.deadline = started_at + self.ttl

    def extend(self, ttl: float | None = None) -> None:
        """Extend this lease (owner-checked). Raises LeaseLost if it is no longer ours."""
        self.check()
        self.backend.extend(self, ttl)

    def release(self) -> bool:
        """Release if still ours. Returns False if it had already expired or moved on."""
        if self._released:
            return False
        try:
            return self.backend.release(self)
        finally:
            self._released = True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
