"""The Redlock backend: locks on a majority of N independent Redis masters, with a fence
that only goes up. The asyncio store is `redlock.store_async.AsyncRedlockStore`."""

from __future__ import annotations

from jobfence.locks.backends.redlock.protocol import NO_REPLY
from jobfence.locks.backends.redlock.rounds import Round, Rounds, never
from jobfence.locks.backends.redlock.store import RedlockBackend

__all__ = ["NO_REPLY", "RedlockBackend", "Round", "Rounds", "never"]
