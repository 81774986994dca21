"""Semaphores on Redis: a key's slots and arrival queue in one hash slot, one Lua call each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jobfence.locks.backends.redis.scripts import script_source
from jobfence.locks.lease import OwnerMeta
from jobfence.locks.slots import SlotInfo, SlotWait, holder_text, parse_holder

if TYPE_CHECKING:
    from jobfence.locks.keys import KeySpace

SEMAPHORE_SCRIPTS = ("sem_acquire", "sem_extend_many", "sem_release", "sem_holders")


def semaphore_keys(prefix: str, key: str) -> list[str]:
    """slots, queue, queue expiry, state, holders: braces keep them in one cluster slot."""
    base = f"{prefix}:sem:{{{key}}}"
    return [f"{base}:slots", f"{base}:queue", f"{base}:qexp", f"{base}:state", f"{base}:holders"]


def sem_acquire_args(
    owner: str, limit: int, ttl_ms: int, queue_ms: int, meta: OwnerMeta, floor: int,
    retention_ms: int,
) -> list[Any]:  # fmt: skip
    """sem_acquire.lua's arguments (its keys: `semaphore_keys`)."""
    return [owner, limit, ttl_ms, queue_ms, holder_text(meta), floor, retention_ms]


def parse_sem_acquire(reply: Any) -> int | SlotWait:
    """sem_acquire.lua's reply: the slot's fence, or where the owner waits."""
    if int(reply[0]) == 1:
        return int(reply[1])
    return SlotWait(position=int(reply[1]), ttl_left=int(reply[2]) / 1000)


def sem_extend_call(
    prefix: str, items: Sequence[tuple[str, str, int]], retention_ms: int
) -> tuple[list[str], list[Any]]:
    args: list[Any] = [retention_ms]
    names: list[str] = []
    for key, owner, ttl_ms in items:
        args += [owner, ttl_ms]
        names += semaphore_keys(prefix, key)  # all five: the extension pushes their expiry out
    return names, args


def sem_release_call(prefix: str, key: str, owner: str) -> tuple[list[str], list[Any]]:
    slots, queue, qexp, _, holders = semaphore_keys(prefix, key)
    return [slots, queue, qexp, holders], [owner]


class RedisSemaphores:
    """The semaphore half of RedisBackend (mixed in): kept apart from the lock scripts."""

    keys: KeySpace
    scripts: dict[str, Any]
    client: Any
    fence_floor: int
    #: How long an idle semaphore's keys stay. Its fence never depends on them: without the
    #: last fence the script falls back to the server clock in µs, above every earlier one.
    semaphore_retention_ms: int = 86_400_000

    def _call(self, name: str, keys: list[str], args: list[Any], key: str | None) -> Any:
        raise NotImplementedError  # RedisBackend's

    def _sem_script(self, name: str, keys: list[str], args: list[Any], key: str | None) -> Any:
        if name not in self.scripts:  # registered on first use: the lock path never pays
            for script in SEMAPHORE_SCRIPTS:
                self.scripts[script] = self.client.register_script(script_source(script))
        return self._call(name, keys, args, key)

    def _sem_keys(self, key: str) -> list[str]:
        return semaphore_keys(self.keys.prefix, key)

    def _sem_acquire(
        self, key: str, owner: str, limit: int, ttl_ms: int, queue_ms: int, meta: OwnerMeta
    ) -> int | SlotWait:
        args = sem_acquire_args(owner, limit, ttl_ms, queue_ms, meta, self.fence_floor,
                                self.semaphore_retention_ms)  # fmt: skip
        got = parse_sem_acquire(self._sem_script("sem_acquire", self._sem_keys(key), args, key))
        if isinstance(got, int) and got > self.fence_floor:
            self.fence_floor = got
        return got

    def _sem_extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        names, args = sem_extend_call(self.keys.prefix, items, self.semaphore_retention_ms)
        return [bool(int(x)) for x in self._sem_script("sem_extend_many", names, args, None)]

    def _sem_release(self, key: str, owner: str) -> bool:
        names, args = sem_release_call(self.keys.prefix, key, owner)
        return bool(int(self._sem_script("sem_release", names, args, key)))

    def _sem_holders(self, key: str) -> list[SlotInfo]:
        names = self._sem_keys(key)
        reply = self._sem_script("sem_holders", [names[0], names[4]], [], key)
        out = []
        for i in range(0, len(reply), 2):
            fence, _, text = str(reply[i]).partition("\n")
            out.append(parse_holder(int(fence), int(reply[i + 1]) / 1000, text))
        return out
