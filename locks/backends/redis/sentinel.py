"""Locks on the master a set of Redis Sentinels names, followed across a failover."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.connection import Connection
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool

from jobfence.config.findings import Finding, LockTarget
from jobfence.config.security import refuse_node
from jobfence.config.urls import sentinel_target
from jobfence.locks.backend import Capabilities
from jobfence.locks.backends.redis import checks as redis_checks
from jobfence.locks.backends.redis.backend import RedisBackend
from jobfence.locks.backends.redis.lane import Lane
from jobfence.locks.backends.redis.protocol import client_options
from jobfence.locks.backends.redis.sentinel_watch import MasterWatch
from jobfence.locks.backends.redis.url import tls_hint, tls_kwargs
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import Lease

# Why the single-node backend serves unchanged: redis-py's `Sentinel.master_for` returns a
# plain redis.Redis whose pool asks the sentinels for the master's address at every new
# connection, so the scripts, the lane and the admin calls all land on the current master.
# A connection to a master that died breaks (BackendUnavailable; the next call reconnects
# to whichever master the sentinels name by then). One to a master demoted to a replica
# gets READONLY for the first write, which redis-py's SentinelManagedConnection turns into
# a ConnectionError ("The previous master is now a slave") and a disconnect: a lock server
# that cannot be reached, never a refusal such as "not the owner". Except for EVALSHA: a
# demoted master lost its script cache with the full resync from its new master, and
# answers NOSCRIPT before it would answer READONLY; so a NOSCRIPT asks the sentinels for
# the master before the script is loaded and sent again. If it moved, the pool drops its
# idle connections (and each busy one when it comes back), and the lane reconnects each of
# its connections in the thread that next takes it. Nothing another thread is using is
# closed under it: every thread's first call meets NOSCRIPT on a fresh server, and closing
# the whole pool there broke the others' commands ("Bad file descriptor").
#
# What connect-time discovery misses: after a clean `SENTINEL FAILOVER` the old master stays
# a writable master (~10 s, until the sentinels' next INFO round demotes it), so connections
# made before the promotion keep working there; renewals on it never reach the new master,
# where the key expires and another worker is granted. So a MasterWatch asks the sentinels
# for the master every MASTER_POLL s (they name the new one as soon as it is promoted, before
# +switch-master is published). Each script call reads the watch's epoch before it is sent
# and after its reply: a call that spanned a change failed (BackendUnavailable), and one sent
# after it went to the new master (the pool dropped the old one's connections first). At a
# change every live lease of this backend is extended on the new master at once: one the new
# master does not confirm (expired there, another's, unreachable) is lost at once.
#
# The fence is the single node's, max(last + 1, server time in µs, this client's floor): a
# promoted replica that never received the newest grant still hands out a higher fence, as
# long as the hosts' clocks agree to within the time between two grants of a key.


@dataclass(frozen=True)
class Topology:
    """What the sentinels say about the master, for the start-up checks."""

    master: tuple[str, int] | None
    replicas: list[tuple[str, int]] = field(default_factory=list)
    #: The most sentinels any answering sentinel knows of, itself included (0: none answered).
    sentinels: int = 0
    #: Why no master was found, when none was.
    error: str = ""
    #: What to fix when that was a TLS set-up or a login that cannot work (waiting won't help).
    hint: str = ""


def sentinel_setup(
    url: str, socket_timeout: float, retry: Any
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """The Sentinel's arguments, the service and `master_for`'s options for `url`, for the
    sync and the asyncio client alike (`retry`: each library's own no-retry object)."""
    target = sentinel_target(url)
    tls = tls_kwargs(target.tls)  # TLS to the sentinels and to the master alike
    login = (
        {"username": target.sentinel_username, "password": target.sentinel_password}
        if target.sentinel_password else {}
    )
    sentinel_args = {
        "sentinels": list(target.sentinels),
        # Believe a sentinel only while it sees a majority of those listed (itself
        # included): one cut off from its peers may still name a deposed master.
        "min_other_sentinels": len(target.sentinels) // 2,
        "sentinel_kwargs": {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
            "retry": retry,
            "decode_responses": True,
            **login,  # the sentinels' own password, not the master's
            **tls,
        },
    }
    master_args = {
        "db": target.db,
        "username": target.username,
        "password": target.password,
        **client_options(socket_timeout),
        "retry": retry,
        **tls,
    }
    return sentinel_args, target.service, master_args



class WatchedSentinel(Sentinel):
    """redis-py's Sentinel whose `discover_master` (what each new connection of the pool
    asks) answers with the master the watch names: redis-py's own takes the first sentinel's
    answer, which for a second or two after a failover may come from one not yet told of
    it, naming the old master again."""

    watch: MasterWatch | None = None
    #: Judges a data node's address before it is connected to (and sent the password).
    judge: Callable[[tuple[str, int], str], None] | None = None

    def discover_master(self, service_name: str) -> Any:
        watch = self.watch
        found = (
            super().discover_master(service_name)  # type: ignore[no-untyped-call]
            if watch is None else watch.master()
        )  # fmt: skip
        if self.judge is not None:
            self.judge((str(found[0]), int(found[1])), "master")
        return found


class _SentinelLane(Lane):
    """A lane that follows the master: a connection made to a master the sentinels no longer
    name is reconnected (to the one they name) by the thread that takes it, the only one
    using it then."""

    def _take(self) -> Connection:
        conn = super()._take()
        master = self.pool.master_address  # type: ignore[attr-defined]
        if master is not None and (conn.host, conn.port) != master:  # type: ignore[attr-defined]
            conn.disconnect()  # type: ignore[no-untyped-call]
        if conn._sock is None:
            # Connect here, through the sentinels' answer: a send on a closed connection
            # reconnects to the host it last had (redis-py), the old master after a failover.
            try:
                conn.connect()  # type: ignore[no-untyped-call]
            except BaseException:
                self.idle.append(conn)
                raise
        return conn


class RedisSentinelBackend(RedisBackend):
    """Locks on the current master of a Sentinel-managed Redis. Build with `from_url`."""

    name: ClassVar[str] = "redis-sentinel"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=True, release_notify=True,
        semaphore=True, rate_limit=True,
    )

    def __init__(self, client: redis.Redis, **options: Any) -> None:
        pool = client.connection_pool
        if not isinstance(pool, SentinelConnectionPool):
            raise TypeError("RedisSentinelBackend needs a client from Sentinel.master_for")
        super().__init__(client, **options)
        if self._lane is not None:
            self._lane = _SentinelLane(pool)
        self.sentinel: Sentinel = pool.sentinel_manager
        self.service: str = pool.service_name
        self.watch = MasterWatch(self)
        if isinstance(self.sentinel, WatchedSentinel):
            self.sentinel.watch = self.watch
            self.sentinel.judge = self.judge_node
        # The epoch the last script call of this thread was confirmed under (for _on_grant).
        self.call_epoch = threading.local()

    @classmethod
    def client_for(cls, url: str, *, socket_timeout: float) -> redis.Redis:
        retry = Retry(NoBackoff(), 0)
        sentinel_args, service, master_args = sentinel_setup(url, socket_timeout, retry)
        sentinel = WatchedSentinel(**sentinel_args)  # type: ignore[no-untyped-call]
        client: redis.Redis = sentinel.master_for(service, **master_args)  # type: ignore[no-untyped-call]
        return client

    def _hint(self, exc: BaseException) -> str | None:
        """As the single node's; when no sentinel answered (redis-py keeps only the kind of
        each one's error), one sentinel is asked again to learn why."""
        hint = tls_hint(exc)
        if hint is not None or "No master found" not in str(exc):
            return hint
        for client in self.sentinel.sentinels:
            try:
                client.ping()
            except RedisError as failed:
                found = tls_hint(failed)
                if found is not None:
                    return f"the sentinels: {found}".replace(
                        "check the user and password in the URL",
                        "check ?sentinel_password= (and sentinel_username=) in the URL")
        return None

    def _call(self, name: str, keys: list[str], args: list[Any], key: str | None) -> Any:
        epoch = self._epoch(name, key)
        reply = super()._call(name, keys, args, key)
        self.watch.confirm(epoch, name, key)
        self.call_epoch.value = epoch
        return reply

    def _call_many(self, name: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        epoch = self._epoch(name, None)
        replies = super()._call_many(name, calls)
        self.watch.confirm(epoch, name, None)
        return replies

    def _epoch(self, name: str, key: str | None) -> int:
        """The watch's epoch to send a script under; BackendUnavailable (with what to fix,
        if the TLS set-up or a login cannot work) if no sentinel names a master."""
        try:
            return self.watch.epoch_now()
        except RedisError as exc:
            hint = self._hint(exc)
            message = f"redis {name} failed" + (f" ({hint})" if hint else "")
            raise BackendUnavailable(message, key=key, cause=exc) from exc

    def _on_grant(self, lease: Lease) -> None:
        self.watch.register(lease, getattr(self.call_epoch, "value", -1))

    def confirm_on_new_master(self, leases: Sequence[Lease]) -> None:
        """After a change of master: extend `leases` there now; one it refuses is lost (by
        extend_many), and all of them if it cannot be asked: a deadline moved by renewals
        on the old master is worth nothing until the new one confirms it."""
        if not leases:
            return
        try:
            self.extend_many(leases)
        except Exception as exc:
            for lease in leases:
                lease.mark_lost(BackendUnavailable(
                    "the sentinels named a new master, which could not confirm the lease",
                    key=lease.key, fence=lease.fence, cause=exc))  # fmt: skip

    def _evalsha(self, sha: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return super()._evalsha(sha, keys, args)
        except NoScriptError:
            self._follow_master()
            raise  # the caller loads the script and sends it once more

    def _evalsha_many(self, sha: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        try:
            return super()._evalsha_many(sha, calls)
        except NoScriptError:
            self._follow_master()
            raise  # as _evalsha

    def _follow_master(self) -> None:
        """Ask the sentinels for the master now (a NOSCRIPT may come from a demoted one). If
        it moved, redis-py's pool drops its idle connections and each busy one as it comes
        back, and the lane reconnects its own at their next use: none is closed under the
        thread using it."""
        self.client.connection_pool.get_master_address()  # type: ignore[attr-defined]

    def discover(self) -> tuple[int, tuple[str, int]]:
        """The sentinels' config epoch and master address, from the sentinel that answers
        with the highest epoch (a failover raises it; one not yet told has the lower) among
        those seeing a majority of the sentinels listed. Every sentinel is asked, in one
        round trip each."""
        best: tuple[int, tuple[str, int]] | None = None
        errors: list[str] = []
        for client in list(self.sentinel.sentinels):
            try:
                with client.pipeline(transaction=False) as pipe:
                    pipe.sentinel_master(self.service)
                    pipe.sentinel_get_master_addr_by_name(self.service)
                    state, addr = pipe.execute()
            except RedisError as exc:
                errors.append(type(exc).__name__)
                continue
            peers = int(state.get("num-other-sentinels", 0))
            if not addr or peers < self.sentinel.min_other_sentinels:
                continue
            found = (int(state.get("config-epoch", 0)), (str(addr[0]), int(addr[1])))
            if best is None or found[0] > best[0]:
                best = found
        if best is None:  # redis-py's error, as its own discovery raises it
            raise MasterNotFoundError(f"No master found for {self.service!r}"
                                      + (f" ({', '.join(errors)})" if errors else ""))  # fmt: skip
        return best

    def master_address(self) -> tuple[str, int]:
        """The master's address as the sentinels name it now (MasterNotFoundError if none
        does: none answers, or the master is down and not yet replaced)."""
        host, port = self.sentinel.discover_master(self.service)  # type: ignore[no-untyped-call]
        return str(host), int(port)

    def topology(self) -> Topology:
        """The master, its live replicas and how many sentinels watch it."""
        try:
            master = self.master_address()
        except RedisError as exc:
            return Topology(master=None, error=f"{type(exc).__name__}: {exc}",
                            hint=self._hint(exc) or "")  # fmt: skip
        known = 0
        for client in self.sentinel.sentinels:
            try:
                state: Any = client.sentinel_master(self.service)
            except RedisError:
                continue
            known = max(known, int(state.get("num-other-sentinels", 0)) + 1)
        try:
            found = self.sentinel.discover_slaves(self.service)  # type: ignore[no-untyped-call]
            replicas = [(str(h), int(p)) for h, p in found]
        except RedisError:
            replicas = []
        return Topology(master=master, replicas=replicas, sentinels=known)

    def judge_node(self, address: tuple[str, int], role: str) -> None:
        """Refuse (UnsafeSettings) a data node the sentinels name that the connection's
        options would reach unsafely (its password in clear text to another host, TLS
        unverified), unless JOBFENCE_ALLOW_INSECURE names that downgrade: the sentinels
        listed in the URL being on loopback says nothing of where the master is."""
        refuse_node(self.security(), address, f"Sentinel {role}")

    def node_client(self, address: tuple[str, int]) -> redis.Redis:
        """A client of one node (a replica, say) with the master's credentials and timeouts;
        the caller closes it."""
        self.judge_node(address, "replica")
        kwargs = self.client.connection_pool.connection_kwargs
        tls = {k: v for k, v in kwargs.items() if k.startswith("ssl")}
        return redis.Redis(
            host=address[0],
            port=address[1],
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            socket_timeout=kwargs.get("socket_timeout"),
            socket_connect_timeout=kwargs.get("socket_connect_timeout"),
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
            **tls,
        )

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        return redis_checks.sentinel_findings(self, target)

    def close(self) -> None:
        self.watch.stop()
        super().close()
        self.sentinel.close()
