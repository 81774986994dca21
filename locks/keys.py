"""Every key name jobfence writes on a key-value lock server, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeySpace:
    """Key names under one prefix. The braces make a lock's keys share one cluster slot."""

    prefix: str = "jobfence"

    def lock(self, key: str) -> str:
        return f"{self.prefix}:lock:{{{key}}}"

    def fence(self, key: str) -> str:
        return f"{self.prefix}:fence:{{{key}}}"

    def fences(self) -> str:
        """The fence source of a Redis server: the highest fence it granted, on any key."""
        return f"{self.prefix}:fences"

    def slot_fences(self, tag: str) -> str:
        """The fence source of one cluster slot; `tag` is a hash tag of that slot."""
        return f"{self.prefix}:fences:{{{tag}}}"

    def record(self, key: str) -> str:
        return f"{self.prefix}:job:{{{key}}}"

    def signal(self, key: str) -> str:
        return f"{self.prefix}:signal:{{{key}}}"

    def evicted(self) -> str:
        """The channel a grant removed by its fence is announced on (Redis)."""
        return f"{self.prefix}:evicted"

    def queued(self, key: str) -> str:
        return f"{self.prefix}:queued:{{{key}}}"

    def deliveries(self, key: str) -> str:
        return f"{self.prefix}:deliveries:{{{key}}}"

    def rate(self, key: str) -> str:
        """A rate limiter's GCRA state (locks/ratelimit.py): one number, its next turn."""
        return f"{self.prefix}:rate:{{{key}}}"

    def resource_fence(self, resource: str) -> str:
        return f"{self.prefix}:rfence:{{{resource}}}"

    def resource_writes(self, resource: str) -> str:
        """The answers of the fenced writes accepted under a resource's current fence."""
        return f"{self.prefix}:rwrites:{{{resource}}}"

    def effect_record(self, resource: str, key: str) -> str:
        """A job's DONE record beside its effect's resource (RedisEffects): in its slot."""
        return f"{self.prefix}:done:{{{resource}}}:{key}"

    def decisions(self, key: str) -> str:
        """A job key's decision log (locks/decisions.py): a capped stream."""
        return f"{self.prefix}:decisions:{{{key}}}"

    def decision_index(self) -> str:
        """The index of recent decisions (job key and task id), so a task id finds its key."""
        return f"{self.prefix}:decisions"

    def lock_pattern(self, match: str = "*") -> str:
        return f"{self.prefix}:lock:{{{match}}}"

    def key_of_lock(self, name: str) -> str:
        head = f"{self.prefix}:lock:{{"
        return name[len(head) : -1] if name.startswith(head) and name.endswith("}") else name
