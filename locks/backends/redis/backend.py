"""The Redis lock backend: one Lua script per operation, fences that survive data loss."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Unpack

import redis
from redis.connection import ConnectionPool, SSLConnection
from redis.exceptions import NoScriptError, RedisError, ResponseError

from jobfence.config.findings import Finding, LockTarget, OutageProbe
from jobfence.config.settings import Settings
from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    LockBackend,
    LockInfo,
    Security,
    validate_key,
)
from jobfence.locks.backends.common import (
    FENCE_RETENTION,
    UrlOptions,
    settings_options,
    url_options,
)
from jobfence.locks.backends.redis import checks as redis_checks
from jobfence.locks.backends.redis.evictions import EvictionWatch, Heard
from jobfence.locks.backends.redis.lane import Lane
from jobfence.locks.backends.redis.protocol import (
    BLPOP_LATE,
    LEGACY_RECORD_FIELDS,
    LOCK_FIELDS,
    SIGNAL_LIFETIME_MS,
    begin_call,
    claim_call,
    client_options,
    commit_call,
    extend_calls,
    legacy_record_of,
    parse_begin,
    parse_extend,
    parse_held,
    parse_lock,
    parse_rate,
    rate_call,
    release_call,
    stored_record,
    swap_call,
    text,
)
from jobfence.locks.backends.redis.scripts import load_scripts
from jobfence.locks.backends.redis.semaphores import RedisSemaphores
from jobfence.locks.backends.redis.url import security_of_kwargs, tls_hint, tls_kwargs, url_tls
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.decisions import DecisionBounds, DecisionLog, RedisDecisionLog
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.keys import KeySpace
from jobfence.locks.lease import OwnerMeta


class RedisBackend(RedisSemaphores, LockBackend):
    """Locks on one Redis server. Build with `from_url` or `from_settings`."""

    name: ClassVar[str] = "redis"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=False, release_notify=True,
        semaphore=True, rate_limit=True,
    )
    #: Whether one script may touch any keys of ours (one server); a Cluster's keys live in
    #: other slots, so its decision log pipelines plain commands instead.
    one_slot: ClassVar[bool] = True

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "jobfence",
        fence_retention: float = FENCE_RETENTION,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(clock=clock)
        self.client = client
        self.keys = KeySpace(prefix)
        # Accepted for open_backend and the settings, unused: the fence source is one key per
        # server (per slot on a cluster), not a counter per lock key kept for a retention.
        del fence_retention
        # The highest fence this client has been granted, on any key: the floor of the next
        # grant, so fences keep increasing if the server loses its data and its clock steps
        # back (fences are server microseconds, so one floor serves every key).
        self.fence_floor = 0
        self.scripts = load_scripts(client)
        # Plain redis.Redis clients get a lane; anything else (a cluster client, a mock)
        # is called through its own evalsha.
        pool = getattr(client, "connection_pool", None)
        self._lane = (
            Lane(pool)
            if type(client) is redis.Redis and isinstance(pool, ConnectionPool)
            else None
        )
        self._tls = issubclass(getattr(pool, "connection_class", object), SSLConnection)
        timeout = getattr(pool, "connection_kwargs", {}).get("socket_timeout")
        self._max_block = max(0.01, 0.8 * timeout) if timeout else 5.0
        #: how late past its block a waiting BLPOP's reply may come (`Lane.blpop`)
        self._late = (timeout or 2.0) + BLPOP_LATE

    @classmethod
    def from_url(cls, url: str, **options: Unpack[UrlOptions]) -> RedisBackend:
        o = url_options(options)
        client = cls.client_for(url, socket_timeout=o.socket_timeout)
        return cls(client, prefix=o.prefix, fence_retention=o.fence_retention,
                   clock=o.clock)  # fmt: skip

    @classmethod
    def client_for(cls, url: str, *, socket_timeout: float) -> redis.Redis:
        """The client `from_url` builds on: a subclass for another topology (Sentinel)
        overrides this alone and keeps every script, the lane and the admin calls."""
        # The ssl_ options as the URL gives them, parsed once for the whole family; the
        # host-name check is set explicitly (redis-py before 6 left it off).
        tls = {k: v for k, v in tls_kwargs(url_tls(url)).items() if k != "ssl"}
        return redis.Redis.from_url(url, **client_options(socket_timeout), **tls)

    @classmethod
    def from_settings(cls, settings: Settings, *, clock: Clock = SYSTEM_CLOCK) -> RedisBackend:
        return cls.from_url(settings.lock_url, clock=clock, **settings_options(settings))

    def security(self) -> Security:
        """TLS and login as the client's connections are configured (the pool's options)."""
        pool: Any = self.client.connection_pool
        return security_of_kwargs(pool.connection_kwargs, self._tls)

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        return redis_checks.server_findings(self, target)

    def outage_probe(self, target: LockTarget) -> OutageProbe | None:
        return redis_checks.ServerProbe(target)

    def _hint(self, exc: BaseException) -> str | None:
        """What to fix when `exc` says the TLS set-up or the login cannot work, else None."""
        return tls_hint(exc)

    def _ping(self) -> str:
        self.client.ping()  # the master a Sentinel names; any node of a cluster
        return "PONG"

    def _evalsha(self, sha: str, keys: list[str], args: list[Any]) -> Any:
        if self._lane is not None:
            return self._lane.call("EVALSHA", sha, len(keys), *keys, *args)
        return self.client.evalsha(sha, len(keys), *keys, *args)

    def _call(self, name: str, keys: list[str], args: list[Any], key: str | None) -> Any:
        # EVALSHA by its precomputed digest, not through redis-py's Script.__call__ (which
        # adds an import and tuple copies per call). A server that lost its script cache
        # (restart, SCRIPT FLUSH) answers NOSCRIPT: load the script and send it again.
        script = self.scripts[name]
        try:
            try:
                return self._evalsha(script.sha, keys, args)
            except NoScriptError:
                script.sha = self.client.script_load(script.script)
                return self._evalsha(script.sha, keys, args)
        except RedisError as exc:
            hint = self._hint(exc)
            message = f"redis {name} failed" + (f" ({hint})" if hint else "")
            raise BackendUnavailable(message, key=key, cause=exc) from exc

    def _take_rate(
        self, key: str, interval_us: float, burst: int, max_wait_us: float
    ) -> tuple[bool, float, float]:
        keys, args = rate_call(self.keys, key, interval_us, burst, max_wait_us)
        return parse_rate(self._call("rate_take", keys, args, key))

    def _evalsha_many(self, sha: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        commands = [("EVALSHA", sha, len(keys), *keys, *args) for keys, args in calls]
        if self._lane is not None:
            return self._lane.call_many(commands)
        with self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)  # type: ignore[no-untyped-call]
            return list(pipe.execute())

    def _call_many(self, name: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """`_call` for several calls of one script in one round trip (scripts safe to send
        again: a NOSCRIPT reply to one of them sends them all again)."""
        script = self.scripts[name]
        try:
            try:
                return self._evalsha_many(script.sha, calls)
            except NoScriptError:
                script.sha = self.client.script_load(script.script)
                return self._evalsha_many(script.sha, calls)
        except RedisError as exc:
            hint = self._hint(exc)
            message = f"redis {name} failed" + (f" ({hint})" if hint else "")
            raise BackendUnavailable(message, cause=exc) from exc

    # -- one round trip each ----------------------------------------------------
    def fence_source(self, key: str) -> str:
        """The key that keeps the highest fence granted: one per server, shared by every
        lock key (a cluster has one per slot: its scripts touch one slot)."""
        return self.keys.fences()

    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        keys, args = begin_call(
            self.keys, self.fence_source(key), key, owner, ttl_ms, meta, record, fingerprint,
            self.fence_floor,
        )  # fmt: skip
        got = parse_begin(self._call("begin", keys, args, key))
        if isinstance(got, int) and got > self.fence_floor:
            self.fence_floor = got  # racing threads may keep an older grant: a floor
        return got

    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        return bool(self._call("extend", [self.keys.lock(key)], [owner, ttl_ms], key))

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        calls = extend_calls(self.keys, items)
        if len(calls) == 1:
            replies = [self._call("extend_many", *calls[0], None)]
        else:
            replies = self._call_many("extend_many", calls)
        return parse_extend(replies)

    def _release(self, key: str, owner: str) -> bool:
        return bool(self._call("release", *release_call(self.keys, key, owner), key))

    def _commit(self, rec: CommitRecord) -> bool:
        return bool(self._call("commit", *commit_call(self.keys, rec), rec.key))

    def _inspect(self, key: str) -> LockInfo | None:
        name = self.keys.lock(key)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hmget(name, *LOCK_FIELDS)
                pipe.pttl(name)
                fields, pttl = pipe.execute()
        except RedisError as exc:
            raise BackendUnavailable("redis inspect failed", key=key, cause=exc) from exc
        return parse_lock(key, fields, int(pttl))

    # -- admin and waiting --------------------------------------------------------
    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        try:
            names = list(self.client.scan_iter(match=self.keys.lock_pattern(match), count=500))
        except RedisError as exc:
            raise BackendUnavailable("redis scan failed", cause=exc) from exc
        for name in names:
            info = self._inspect(self.keys.key_of_lock(text(name)))
            if info is not None:
                yield info

    def job_record(self, key: str) -> JobRecord | None:
        name = self.keys.record(key)
        try:
            try:
                raw = self.client.get(name)
            except ResponseError as exc:  # WRONGTYPE: a record hash an earlier version wrote
                if "WRONGTYPE" not in str(exc):
                    raise
                return legacy_record_of(self.client.hmget(name, LEGACY_RECORD_FIELDS))
        except RedisError as exc:
            raise BackendUnavailable("redis job_record failed", key=key, cause=exc) from exc
        return stored_record(raw)

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        return parse_held(self._call("claim_publish", *claim_call(self.keys, key, task_id, ttl),
                                     key))  # fmt: skip

    def clear_publish(self, key: str) -> None:
        try:
            self.client.delete(self.keys.queued(key))
        except RedisError as exc:
            raise BackendUnavailable("redis clear_publish failed", key=key, cause=exc) from exc

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        keys, args = swap_call(self.keys, key, expect, new, ttl_ms)
        return parse_held(self._call("swap_publish", keys, args, key))

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        name = self.keys.deliveries(key)
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.incr(name)
                pipe.pexpire(name, window_ms)
                count, _ = pipe.execute()
        except RedisError as exc:
            raise BackendUnavailable("redis count_delivery failed", key=key, cause=exc) from exc
        return int(count)

    def forget(self, key: str) -> bool:
        return bool(self.client.delete(self.keys.record(key)))

    def force_release(self, key: str) -> bool:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.lock(key))
            pipe.rpush(self.keys.signal(key), "1")
            pipe.pexpire(self.keys.signal(key), SIGNAL_LIFETIME_MS)
            deleted, _, _ = pipe.execute()
        return bool(deleted)

    def release_grant(self, key: str, fence: int) -> bool:
        """Remove `key`'s lock if still held under `fence`: checked in the deleting script."""
        validate_key(key)
        k = self.keys
        return bool(self._call("release_grant", [k.lock(key), k.signal(key)],
                               [str(fence), SIGNAL_LIFETIME_MS, k.evicted(), key],
                               key))  # fmt: skip

    def watch_evictions(self, heard: Heard) -> EvictionWatch | None:
        """A watcher of this server's eviction notices (one node or a Sentinel master; a
        Cluster's keepers find an eviction at the next extension, as other backends do)."""
        if not isinstance(self.client, redis.Redis):
            return None
        return EvictionWatch(self.client, self.keys.evicted(), heard).start()

    def wait_for_release(self, key: str, timeout: float) -> None:
        """BLPOP the key's signal list: returns at once when the holder releases.

        The refused attempt before it marked the lock as waited on, and only such a lock's
        release pushes the signal, so call this after a Busy answer (as `acquire` does).
        """
        timeout = min(timeout, self._max_block)
        if timeout < 0.001:
            return
        signal = self.keys.signal(key)
        lane = self._lane_of(signal)
        try:
            if lane is not None:
                lane.blpop(signal, timeout, self._late)
            else:
                fit = max(0.01, min(timeout, 0.5 * (self._late - BLPOP_LATE)))
                self.client.blpop([signal], timeout=fit)
        except RedisError as exc:
            raise BackendUnavailable("redis wait failed", key=key, cause=exc) from exc

    def _lane_of(self, name: str) -> Lane | None:
        """The lane of the server that holds `name` (None: call through the client)."""
        return self._lane

    def decision_log(self, bounds: DecisionBounds) -> DecisionLog | None:
        lane, script = self._lane, self._decisions_script if self.one_slot else None
        return RedisDecisionLog(self.client, self.keys, bounds, script=script,
                                send_many=lane.call_many if lane is not None else None)  # fmt: skip

    def _decisions_script(self, keys: list[str], args: list[Any]) -> Any:
        return self._call("decisions_append", keys, args, None)

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        self.client.close()
