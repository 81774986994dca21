"""The semaphore half of LockBackend: validate, then one call; a backend keeps semaphores by
overriding the `_sem_` methods (each one round trip)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, cast

from jobfence.locks.clock import Clock
from jobfence.locks.errors import SemaphoreUnsupported
from jobfence.locks.lease import OwnerMeta, new_owner_token
from jobfence.locks.registry import Capabilities, backends_with
from jobfence.locks.slots import SlotInfo, SlotLease, SlotWait, validate_limit
from jobfence.locks.validation import default_meta, validate_key, validate_ttl

if TYPE_CHECKING:  # only types: that module imports this one
    from jobfence.locks.backend import LockBackend


class BackendSemaphores:
    """Mixed into LockBackend: the public semaphore calls and the `_sem_` defaults that
    refuse them (SemaphoreUnsupported)."""

    capabilities: ClassVar[Capabilities]
    name: ClassVar[str]
    clock: Clock

    def semaphore_attempt(
        self,
        key: str,
        limit: int,
        ttl: float,
        *,
        owner: str | None = None,
        meta: OwnerMeta | None = None,
        queue_ttl: float = 0.0,
    ) -> SlotLease | SlotWait:
        """Take a slot of semaphore `key` if fewer than `limit` are held and no earlier
        waiter is owed it; else say how many wait ahead.

        With `queue_ttl` > 0 a refused `owner` takes (or keeps) its place in the arrival
        queue for `queue_ttl` seconds; poll again with the same owner to keep it. With 0
        the attempt is a plain try that never jumps the queue: it takes a slot only if one
        is free beyond those owed to waiters.
        """
        self.require_semaphore()
        validate_key(key)
        validate_limit(limit, key)
        ttl_ms = validate_ttl(ttl)
        queue_ms = validate_ttl(queue_ttl) if queue_ttl > 0 else 0
        owner = owner or new_owner_token()
        meta = meta or default_meta()
        started = self.clock.monotonic()
        got = self._sem_acquire(key, owner, limit, ttl_ms, queue_ms, meta)
        if isinstance(got, SlotWait):
            return got
        backend = cast("LockBackend", self)
        return SlotLease.granted(backend, key, owner, got, ttl_ms, started, meta, limit=limit)

    def semaphore_leave(self, key: str, owner: str) -> bool:
        """Give up `owner`'s place in the queue of `key`, or its slot if it got one."""
        self.require_semaphore()
        validate_key(key)
        return self._sem_release(key, owner)

    def semaphore_holders(self, key: str) -> list[SlotInfo]:
        """The live slots of semaphore `key`, oldest fence first."""
        self.require_semaphore()
        validate_key(key)
        return sorted(self._sem_holders(key), key=lambda s: s.fence)

    def require_semaphore(self) -> None:
        """Raise SemaphoreUnsupported unless this backend keeps semaphores."""
        if not self.capabilities.semaphore:
            raise SemaphoreUnsupported(
                f"the {self.name} lock backend keeps no semaphores (concurrency limits); "
                f"use one that does: {backends_with('semaphore', fleet=False)}"
            )

    def _sem_acquire(
        self, key: str, owner: str, limit: int, ttl_ms: int, queue_ms: int, meta: OwnerMeta
    ) -> int | SlotWait:
        """The new slot's fence, or SlotWait. One atomic step on the server."""
        raise SemaphoreUnsupported(f"{self.name} keeps no semaphores")

    def _sem_extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        raise SemaphoreUnsupported(f"{self.name} keeps no semaphores")

    def _sem_release(self, key: str, owner: str) -> bool:
        """Free `owner`'s slot and drop it from the queue; True if a live slot was freed."""
        raise SemaphoreUnsupported(f"{self.name} keeps no semaphores")

    def _sem_holders(self, key: str) -> list[SlotInfo]:
        raise SemaphoreUnsupported(f"{self.name} keeps no semaphores")
