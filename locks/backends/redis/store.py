"""The Redis lock backend: one Lua script per operation, fences that survive data loss."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.connection import Connection, ConnectionPool, SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

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
from jobfence.locks.backends.common import settings_options
from jobfence.locks.backends.redis import checks as redis_checks
from jobfence.locks.backends.redis.scripts import load_scripts
from jobfence.locks.backends.redis.semaphore import RedisSemaphores
from jobfence.locks.backends.redis.url import CA_FILE_HINT as CA_FILE_HINT
from jobfence.locks.backends.redis.url import security_of_kwargs, tls_kwargs, url_tls
from jobfence.locks.backends.redis.url import tls_hint as tls_hint
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.decisions import DecisionBounds, DecisionLog, RedisDecisionLog
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.keys import KeySpace
from jobfence.locks.lease import OwnerMeta

SIGNAL_LIFETIME_MS = 2000
#: Leases per extend_many script: a batch of more goes as several scripts in one write (one
#: round trip), so the server serves other clients between them instead of stalling for all.
EXTEND_CHUNK = 1000

_pack_big: Callable[[tuple[Any, ...]], bytes] | None
try:  # a core dependency; packs any command at a third of the cost of the Python packer
    from hiredis import pack_command as _pack_big
except ImportError:  # pragma: no cover
    _pack_big = None
DEFAULT_FENCE_RETENTION = 30 * 24 * 3600.0


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_record(raw: str) -> JobRecord:
    """A job record as commit.lua stores it: '<D|F><fence>,<ms from grant to finish>,
    <length of the fingerprint>:<fingerprint><result>'."""
    first = raw.index(",", 1)
    second = raw.index(",", first + 1)
    colon = raw.index(":", second + 1)
    fence = int(raw[1:first])
    end = colon + 1 + int(raw[second + 1 : colon])
    return JobRecord(
        state=_STATES[raw[0]],
        fingerprint=raw[colon + 1 : end],
        result=raw[end:],
        fence=fence,
        finished_at=(fence // 1000 + int(raw[first + 1 : second])) / 1000,
    )


_STATES = {"D": "DONE", "F": "FAILED"}


#: The fields of a record hash written by versions before the one-string record.
LEGACY_RECORD_FIELDS = ("state", "fingerprint", "result", "fence", "finished_ms")


def stored_record(raw: Any) -> JobRecord | None:
    """A GET of the record key: the job record, or None if there is none."""
    return parse_record(_s(raw)) if raw else None


def legacy_record_of(fields: Sequence[Any]) -> JobRecord | None:
    """An HMGET of LEGACY_RECORD_FIELDS (the key held a record hash): its record, if any."""
    if fields[0] is None:
        return None
    return _legacy_record(*(_s(f) if f is not None else "" for f in fields))


def _legacy_record(state: str, fp: str, result: str, fence: str, finished_ms: str) -> JobRecord:
    """A record hash written by versions before the one-string record (read, never written)."""
    return JobRecord(
        state=state,
        fingerprint=fp,
        result=result,
        fence=int(fence or 0),
        finished_at=int(finished_ms or 0) / 1000,
    )


def client_options(socket_timeout: float) -> dict[str, Any]:
    """The options of every client of a lock server, whatever finds the server."""
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
        "decode_responses": True,
        "health_check_interval": 0,
        # No client-side retries: a hung server must fail within socket_timeout, and a
        # re-sent acquire or commit is not idempotent.
        "retry": Retry(NoBackoff(), 0),
    }


# -- each script's keys, arguments and reply, shared by RedisBackend and the asyncio store
# (locks/backends/redis/store_async.py): one protocol, two transports.
def begin_call(
    k: KeySpace,
    fence_source: str,
    key: str,
    owner: str,
    ttl_ms: int,
    meta: OwnerMeta,
    record: bool,
    fingerprint: str,
    floor: int,
) -> tuple[list[str], list[Any]]:
    """begin.lua's keys and arguments."""
    holder = f"{meta.host}\n{meta.pid}\n{meta.task_name}\n{meta.process_start}"
    if record:
        return (
            [k.lock(key), fence_source, k.record(key)],
            [owner, ttl_ms, "1", meta.task_id, holder, fingerprint, floor],
        )
    return [k.lock(key), fence_source], [owner, ttl_ms, "0", meta.task_id, holder, "", floor]


def parse_begin(reply: Any) -> int | Busy | JobRecord:
    """begin.lua's reply: the new fence, Busy, or the job record."""
    if not isinstance(reply, list):
        return int(reply)
    if int(reply[0]) == 0:
        pttl = int(reply[1])
        return Busy(
            ttl_left=pttl / 1000 if pttl >= 0 else float("inf"),
            task_id=_s(reply[2]) if len(reply) > 2 else "",
            fingerprint=_s(reply[3]) if len(reply) > 3 else "",
        )
    if len(reply) == 2:
        return parse_record(_s(reply[1]))
    return _legacy_record(*(_s(x) for x in reply[1:]))


def extend_calls(
    k: KeySpace, items: Sequence[tuple[str, str, int]]
) -> list[tuple[list[str], list[Any]]]:
    """extend_many.lua's calls for `items`, EXTEND_CHUNK leases a call."""
    lock = k.lock
    calls: list[tuple[list[str], list[Any]]] = []
    for i in range(0, len(items), EXTEND_CHUNK):
        chunk = items[i : i + EXTEND_CHUNK]
        args: list[Any] = []
        for _, owner, ttl_ms in chunk:
            args += (owner, ttl_ms)
        calls.append(([lock(key) for key, _, _ in chunk], args))
    return calls


def parse_extend(replies: list[Any]) -> list[bool]:
    return [bool(int(x)) for reply in replies for x in reply]


def release_call(k: KeySpace, key: str, owner: str) -> tuple[list[str], list[Any]]:
    return [k.lock(key), k.signal(key)], [owner, SIGNAL_LIFETIME_MS]


def rate_call(
    k: KeySpace, key: str, interval_us: float, burst: int, max_wait_us: float
) -> tuple[list[str], list[Any]]:
    # Finite text for Lua: an unbounded wait is any wait.
    cap = min(max_wait_us, 1e18)
    return [k.rate(key)], [repr(interval_us), burst, repr(cap)]


def parse_rate(reply: Any) -> tuple[bool, float, float]:
    return reply[0] == 1, float(reply[1]), float(reply[2])


def commit_call(k: KeySpace, rec: CommitRecord) -> tuple[list[str], list[Any]]:
    """commit.lua's keys and arguments."""
    key, owner, fence, state, result, fingerprint, result_ttl_ms = rec
    # The record string's head and tail (commit.lua puts the finish time between them).
    head, tail = f"{state[0]}{fence}", f"{len(fingerprint)}:{fingerprint}{result}"
    return ([k.lock(key), k.record(key), k.signal(key)],
            [owner, head, tail, result_ttl_ms, SIGNAL_LIFETIME_MS])  # fmt: skip


def claim_call(k: KeySpace, key: str, task_id: str, ttl: float) -> tuple[list[str], list[Any]]:
    """claim_publish.lua's keys and arguments."""
    return [k.queued(key)], [task_id, int(ttl * 1000)]


def swap_call(
    k: KeySpace, key: str, expect: str, new: str | None, ttl_ms: int
) -> tuple[list[str], list[Any]]:
    """swap_publish.lua's keys and arguments."""
    return [k.queued(key)], [expect, new or "", ttl_ms]


def parse_held(reply: Any) -> str | None:
    """claim_publish.lua's and swap_publish.lua's reply: the value that kept the claim."""
    return _s(reply) if reply else None


#: How late, past its block and the socket timeout, Redis may answer a BLPOP: it answers a
#: timed-out one on its next event-loop tick (up to 100 ms late at the default hz 10, a
#: second at hz 1). A client that reads the reply with its socket timeout alone (a
#: cluster's, a mock) blocks at most half of that timeout instead.
BLPOP_LATE = 1.0


class _Lane:
    """Connections kept out of the client's pool for the one-script calls on the hot path.

    redis-py checks a connection out of its pool for every command (a lock, and a peek at
    the socket to make sure it is clean) and back in afterwards; that costs more than the
    round trip itself on a loopback server. A lane keeps its own idle connections instead:
    made by the pool (same options: timeouts, TLS, auth), used by one thread at a time,
    checked before each use as the pool would, reconnected if an error closed them
    (redis-py disconnects on any error but an error reply), never retried after a command
    went out, and forgotten after a fork (the parent's sockets are not the child's).
    """

    def __init__(self, pool: ConnectionPool, node: str | None = None) -> None:
        self.pool = pool
        self.node = node  # the cluster node's name, where the lane serves one
        self.pid = os.getpid()
        self.idle: list[Connection] = []
        self.encoder = pool.get_encoder()
        # hiredis packs str as strict UTF-8, int and float as redis-py does (the same bytes)
        # at a third of the Python packer's cost (one pack per script call on the hot path);
        # a pool with another text encoding keeps the Python packer.
        utf8 = self.encoder.encoding.lower().replace("_", "-") in ("utf-8", "utf8")
        if _pack_big is not None and utf8 and self.encoder.encoding_errors == "strict":
            self.pack: Callable[[tuple[Any, ...]], bytes] = _pack_big
        else:
            self.pack = self.pack_py
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (lane := ref()) and lane._forked())  # type: ignore[func-returns-value]

    def _forked(self) -> None:
        # redis-py resets its pool in a child under the pool's own locks, which a thread of the
        # parent may have held at the fork (making a connection for the keeper or the decision
        # log's writer): the child's first command would wait for ever. Nothing of the child
        # holds them yet.
        self.pid, self.idle = os.getpid(), []
        for name in ("_fork_lock", "_lock"):
            if hasattr(self.pool, name):
                setattr(self.pool, name, threading.RLock())

    def pack_py(self, args: tuple[Any, ...]) -> bytes:
        """The command as RESP bytes: what redis-py's packer sends, at a third of its cost."""
        enc = self.encoder
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            kind = type(arg)
            if kind is str:
                data = arg.encode(enc.encoding, enc.encoding_errors)
            elif kind is int:
                data = b"%d" % arg
            else:  # bytes, float; refuses what redis-py refuses
                data = enc.encode(arg)  # type: ignore[no-untyped-call]
            parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
        return b"".join(parts)

    def _take(self) -> Connection:
        if self.pid != os.getpid():
            self.pid, self.idle = os.getpid(), []
        try:
            conn = self.idle.pop()  # atomic: no two threads get the same connection
        except IndexError:
            return self.pool.get_connection()
        # As the pool does before lending one: a connection with something to read was
        # closed by the server (restart, idle timeout) or holds a stray reply; reconnect it
        # now, before sending, rather than fail a command the server never saw.
        try:
            stale = conn.can_read(timeout=0)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            stale = True
        if stale:
            conn.disconnect()  # type: ignore[no-untyped-call]
        return conn

    def call(self, *args: Any) -> Any:
        conn = self._take()
        try:
            conn.send_packed_command([self.pack(args)])  # type: ignore[no-untyped-call]
            return conn.read_response()
        finally:
            self.idle.append(conn)

    def blpop(self, name: str, block: float, late: float) -> Any:
        """BLPOP `name` for up to `block` seconds, its reply awaited up to `late` seconds past
        the block instead of the socket timeout alone: Redis answers a timed-out BLPOP on
        its next event-loop tick (up to 100 ms late at the default hz), later on a loaded
        host, and a blocked read that outlives the socket timeout is not a dead server."""
        conn = self._take()
        try:
            conn.send_packed_command([self.pack(("BLPOP", name, block))])  # type: ignore[no-untyped-call]
            if not conn.can_read(timeout=block + late):
                conn.disconnect()  # type: ignore[no-untyped-call]
                raise RedisTimeoutError(f"no reply {block + late:g}s after a {block:g}s BLPOP")
            return conn.read_response()
        finally:
            self.idle.append(conn)

    def call_many(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Several commands in one write and their replies in one read: one round trip.
        Every reply is read before an error reply is raised (the first), so the connection
        stays clean."""
        conn = self._take()
        try:
            pack = self.pack
            conn.send_packed_command([pack(c) for c in commands])  # type: ignore[no-untyped-call]
            replies: list[Any] = []
            error: ResponseError | None = None
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:
                    error = error or exc
                    replies.append(exc)
            if error is not None:
                raise error
            return replies
        finally:
            self.idle.append(conn)

    def close(self) -> None:
        idle, self.idle = self.idle, []
        if self.pid == os.getpid():
            for conn in idle:
                self.pool.release(conn)


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
        fence_retention: float = DEFAULT_FENCE_RETENTION,
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
            _Lane(pool)
            if type(client) is redis.Redis and isinstance(pool, ConnectionPool)
            else None
        )
        self._tls = issubclass(getattr(pool, "connection_class", object), SSLConnection)
        timeout = getattr(pool, "connection_kwargs", {}).get("socket_timeout")
        self._max_block = max(0.01, 0.8 * timeout) if timeout else 5.0
        #: how late past its block a waiting BLPOP's reply may come (`_Lane.blpop`)
        self._late = (timeout or 2.0) + BLPOP_LATE

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
        client = cls.client_for(url, socket_timeout=socket_timeout)
        return cls(client, prefix=prefix, fence_retention=fence_retention, clock=clock)

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
                # 'holder' packs host, pid and task name; the separate fields are read too,
                # for locks written by versions that stored them one by one.
                pipe.hmget(
                    name,
                    "fence",
                    "task_id",
                    "holder",
                    "acquired_ms",
                    "heartbeat_ms",
                    "host",
                    "pid",
                    "task_name",
                )
                pipe.pttl(name)
                fields, pttl = pipe.execute()
        except RedisError as exc:
            raise BackendUnavailable("redis inspect failed", key=key, cause=exc) from exc
        if fields[0] is None or int(pttl) == -2:
            return None
        fence, task_id, holder, acq, hb, host, pid, task_name = (
            _s(f) if f is not None else "" for f in fields
        )
        started = ""
        if holder:
            host, pid, task_name, started = [*holder.split("\n", 3), "", "", ""][:4]
        return LockInfo(
            key=key,
            fence=int(fence),
            ttl_left=max(0, int(pttl)) / 1000,
            host=host,
            pid=int(pid or 0),
            task_id=task_id,
            task_name=task_name,
            acquired_at=int(acq or 0) / 1000,
            # Not written at acquire: until the first extension it is the acquisition time.
            last_heartbeat=int(hb or acq or 0) / 1000,
            process_start=started,
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
                               [str(fence), SIGNAL_LIFETIME_MS], key))  # fmt: skip

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

    def _lane_of(self, name: str) -> _Lane | None:
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
