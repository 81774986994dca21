"""The Redis lock backend: one Lua script per operation, fences that survive data loss."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from config.settings import Settings
from locks.backend import Busy, Capabilities, JobRecord, LockBackend, LockInfo
from locks.clock import SYSTEM_CLOCK, Clock
from locks.errors import BackendUnavailable
from locks.keys import KeySpace
from locks.lease import OwnerMeta
from locks.scripts import load_scripts

SIGNAL_LIFETIME_MS = 2000
DEFAULT_FENCE_RETENTION = 30 * 24 * 3600.0


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisBackend(LockBackend):
    """Locks on one Redis server. Build with `from_url` or `from_settings`."""

    name: ClassVar[str] = "redis"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=False, release_notify=True
    )

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "jobfence",
        fence_retention: float = DEFAULT_FENCE_RETENTION,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(clock=clock)
        self.client = client
        self.keys = KeySpace(prefix)
        self.fence_retention_ms = int(fence_retention * 1000)
        self.scripts = load_scripts(client)
        timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
        self._max_block = max(0.01, 0.8 * timeout) if timeout else 5.0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = DEFAULT_FENCE_RETENTION,
        clock: Clock = SYSTEM_CLOCK,
    ) -> RedisBackend:
        client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            decode_responses=True,
            health_check_interval=0,
            # No client-side retries: a hung server must fail within socket_timeout, and a
            # re-sent acquire or commit is not idempotent.
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, prefix=prefix, fence_retention=fence_retention, clock=clock)

    @classmethod
    def from_settings(cls, settings: Settings, *, clock: Clock = SYSTEM_CLOCK) -> RedisBackend:
        return cls.from_url(
            settings.lock_url,
            prefix=settings.key_prefix,
            socket_timeout=settings.socket_timeout,
            fence_retention=settings.fence_retention,
            clock=clock,
        )

    def _call(self, name: str, keys: list[str], args: list[Any], key: str | None) -> Any:
        try:
            return self.scripts[name](keys=keys, args=args)
        except RedisError as exc:
            raise BackendUnavailable(f"redis {name} failed", key=key, cause=exc) from exc

    # -- one round trip each ----------------------------------------------------
    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        k = self.keys
        reply = self._call(
            "begin",
            [k.lock(key), k.fence(key), k.record(key)],
            [
                owner,
                ttl_ms,
                max(self.fence_retention_ms, ttl_ms),
                meta.host,
                meta.pid,
                meta.task_id,
                meta.task_name,
                "1" if record else "0",
                fingerprint,
            ],
            key,
        )
        code = int(reply[0])
        if code == 1:
            return int(_s(reply[1]))
        if code == 0:
            pttl = int(reply[1])
            return Busy(ttl_left=pttl / 1000 if pttl >= 0 else float("inf"),
                        task_id=_s(reply[2]) if len(reply) > 2 else "")
        _, state, fp, result, fence, finished_ms = (_s(x) for x in reply)
        return JobRecord(
            state=state,
            fingerprint=fp,
            result=result,
            fence=int(fence),
            finished_at=int(finished_ms) / 1000,
        )

    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        return bool(self._call("extend", [self.keys.lock(key)], [owner, ttl_ms], key))

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        args: list[Any] = []
        for _, owner, ttl_ms in items:
            args += [owner, ttl_ms]
        reply = self._call("extend_many", [self.keys.lock(k) for k, _, _ in items], args, None)
        return [bool(int(x)) for x in reply]

    def _release(self, key: str, owner: str) -> bool:
        k = self.keys
        return bool(
            self._call("release", [k.lock(key), k.signal(key)], [owner, SIGNAL_LIFETIME_MS], key)
        )

    def _commit(
        self,
        key: str,
        owner: str,
        fence: int,
        state: str,
        result: str,
        fingerprint: str,
        result_ttl_ms: int,
    ) -> bool:
        k = self.keys
        return bool(
            self._call(
                "commit",
                [k.lock(key), k.record(key), k.signal(key)],
                [owner, state, result, fingerprint, fence, result_ttl_ms, SIGNAL_LIFETIME_MS],
                key,
            )
        )

    def _inspect(self, key: str) -> LockInfo | None:
        name = self.keys.lock(key)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hmget(
                    name,
                    "fence",
                    "host",
                    "pid",
                    "task_id",
                    "task_name",
                    "acquired_ms",
                    "heartbeat_ms",
                )
                pipe.pttl(name)
                fields, pttl = pipe.execute()
        except RedisError as exc:
            raise BackendUnavailable("redis inspect failed", key=key, cause=exc) from exc
        if fields[0] is None or int(pttl) == -2:
            return None
        fence, host, pid, task_id, task_name, acq, hb = (
            _s(f) if f is not None else "" for f in fields
        )
        return LockInfo(
            key=key,
            fence=int(fence),
            ttl_left=max(0, int(pttl)) / 1000,
            host=host,
            pid=int(pid or 0),
            task_id=task_id,
            task_name=task_name,
            acquired_at=int(acq or 0) / 1000,
            last_heartbeat=int(hb or 0) / 1000,
        )

    # -- admin and waiting --------------------------------------------------------
    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        try:
            names = list(self.client.scan_iter(match=self.keys.lock_pattern(match), count=500))
        except RedisError as exc:
            raise BackendUnavailable("redis scan failed", cause=exc) from exc
        for name in names:
            info = self._inspect(self.keys.key_of_lock(_s(name)))
            if info is not None:
                yield info

    def job_record(self, key: str) -> JobRecord | None:
        try:
            raw = self.client.hgetall(self.keys.record(key))
        except RedisError as exc:
            raise BackendUnavailable("redis job_record failed", key=key, cause=exc) from exc
        rec = {_s(a): _s(b) for a, b in raw.items()}
        if rec.get("state") not in ("DONE", "FAILED"):
            return None
        return JobRecord(
            state=rec["state"],
            fingerprint=rec.get("fingerprint", ""),
            result=rec.get("result", ""),
            fence=int(rec.get("fence", 0)),
            finished_at=int(rec.get("finished_ms", 0)) / 1000,
        )

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        held = self._call("claim_publish", [self.keys.queued(key)], [task_id, int(ttl * 1000)],
                          key)
        return _s(held) if held else None

    def clear_publish(self, key: str) -> None:
        try:
            self.client.delete(self.keys.queued(key))
        except RedisError as exc:
            raise BackendUnavailable("redis clear_publish failed", key=key, cause=exc) from exc

    def forget(self, key: str) -> bool:
        return bool(self.client.delete(self.keys.record(key)))

    def force_release(self, key: str) -> bool:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.lock(key))
            pipe.rpush(self.keys.signal(key), "1")
            pipe.pexpire(self.keys.signal(key), SIGNAL_LIFETIME_MS)
            deleted, _, _ = pipe.execute()
        return bool(deleted)

    def wait_for_release(self, key: str, timeout: float) -> None:
        """BLPOP the key's signal list: returns at once when a holder releases."""
        timeout = min(timeout, self._max_block)
        if timeout < 0.001:
            return
        try:
            self.client.blpop([self.keys.signal(key)], timeout=timeout)
        except RedisError as exc:
            raise BackendUnavailable("redis wait failed", key=key, cause=exc) from exc

    def close(self) -> None:
        self.client.close()
