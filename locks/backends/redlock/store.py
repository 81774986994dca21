"""The sync Redlock backend: N independent Redis masters, a fence that only goes up, each op
one of the flows of rounds (grant.py, flows.py) carried on one link per master (links.py)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, ClassVar, TypeVar, Unpack

from redis.exceptions import RedisError

from jobfence.config.findings import Finding, LockTarget
from jobfence.config.settings import Settings
from jobfence.config.urls import redlock_masters
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
from jobfence.locks.backends.redis.scripts import script_source
from jobfence.locks.backends.redlock.checks import check_masters, masters_security, ping_masters
from jobfence.locks.backends.redlock.flows import OpRounds
from jobfence.locks.backends.redlock.grant import GrantRounds
from jobfence.locks.backends.redlock.links import carry, checkin, checkout
from jobfence.locks.backends.redlock.masters import Link, Master
from jobfence.locks.backends.redlock.rounds import SIGNAL_LIFETIME_MS, Done, Round, Rounds, advance
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable, LockError
from jobfence.locks.keys import KeySpace
from jobfence.locks.lease import OwnerMeta

T = TypeVar("T")


class RedlockUrlOptions(UrlOptions, total=False):
    """`UrlOptions` and whether a grant round may also commit (True: one round trip)."""

    one_round: bool
SCRIPTS = (
    "redlock_begin",
    "redlock_fence",
    "redlock_commit",
    "redlock_inspect",
    "redlock_admin",
    "release",
    "extend",
    "extend_many",
    "claim_publish",
    "swap_publish",
)


class RedlockBackend(GrantRounds, OpRounds, LockBackend):
    """Locks on a majority of N independent Redis masters. Build with `from_url`.

    A grant takes the lock on every master in parallel and counts only with a majority
    and validity left (TTL - elapsed - drift, on the monotonic clock). Its fence is
    written, under the lock, on a majority: phase one asks every master for
    max(stored fence, server µs); phase two writes max + 1 where the stored fence is
    lower. The client proposes a fence with phase one (above its own clock and every fence
    it has seen); where every master that locked took the proposal, that was phase two
    and the grant is done in one round trip. See the README's "Lock backends" for what it
    guarantees and where it breaks.
    """

    name: ClassVar[str] = "redlock"
    # The fence is durable only where every master keeps its data through a crash (AOF,
    # appendfsync always): `check_servers` finds out and says so on this instance.
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=False, ha=True, release_notify=True
    )

    def __init__(
        self,
        urls: Sequence[str],
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = FENCE_RETENTION,
        one_round: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(clock=clock)
        if len(urls) < 3 or len(urls) % 2 == 0:
            raise LockError(
                f"redlock needs an odd number of masters, at least 3; got {len(urls)} "
                "(JOBFENCE_LOCK_URL=redlock://host:port,host:port,host:port)"
            )
        self.keys = KeySpace(prefix)
        self.fence_retention_ms = int(fence_retention * 1000)
        self.socket_timeout = socket_timeout
        self.one_round = one_round
        sources = {name: script_source(name) for name in SCRIPTS}
        self.sha = {n: hashlib.sha1(s.encode()).hexdigest() for n, s in sources.items()}
        self.masters = [Master(u, socket_timeout=socket_timeout, scripts=sources) for u in urls]
        self.quorum = len(self.masters) // 2 + 1
        self.fence_floor = 0  # the highest fence granted to this client, on any key
        self.rounds = 0  # parallel round trips made (each sends one command per master)
        self._max_block = max(0.01, 0.8 * socket_timeout)
        self._wait_on = 0  # the master waiters block on; moves on when it fails
        # key -> a master that refused this client's last attempt on it, and so marked the
        # lock waited on: its release signals there. The default master may have run the
        # attempt after the release, and never signal (CI once waited a release out).
        self._marked: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options: Unpack[RedlockUrlOptions]) -> RedlockBackend:
        """`redlock://[user:password@]host:port,host:port,host:port[,...][/db]`."""
        o = url_options(options)
        return cls(
            redlock_masters(url),
            prefix=o.prefix,
            socket_timeout=o.socket_timeout,
            fence_retention=o.fence_retention,
            one_round=options.get("one_round", True),
            clock=o.clock,
        )

    @classmethod
    def from_settings(cls, settings: Settings, *, clock: Clock = SYSTEM_CLOCK) -> RedlockBackend:
        return cls.from_url(settings.lock_url, clock=clock, **settings_options(settings))

    # -- the parallel round trip ----------------------------------------------------
    def _run(self, flow: Rounds[T]) -> T:
        """Carry `flow`'s rounds on one link per master, in this thread."""
        links = checkout(self.masters)
        try:
            replies: Any = None
            error: BaseException | None = None
            while not isinstance(step := advance(flow, replies, error), Done):
                replies = error = None
                try:
                    replies = self._round(links, step)
                except BaseException as exc:  # Ctrl-C: the flow frees what it may hold
                    error = exc
            return step.value
        finally:
            checkin(self.masters, links)

    def _round(self, links: list[Link | None], step: Round) -> dict[int, Any]:
        """One round on `links` (links.carry), counted in `rounds`."""
        self.rounds += 1
        return carry(self.masters, links, step)

    # -- the ops, each one flow of rounds --------------------------------------------
    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        return self._run(self.begin_rounds(key, owner, ttl_ms, meta, record, fingerprint))

    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self._run(self.extend_rounds(key, owner, ttl_ms))

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        return self._run(self.extend_many_rounds(items))

    def _release(self, key: str, owner: str) -> bool:
        return self._run(self.release_rounds(key, owner))

    def _commit(self, rec: CommitRecord) -> bool:
        return self._run(self.commit_rounds(rec))

    def _inspect(self, key: str) -> LockInfo | None:
        return self._run(self.inspect_rounds(key))

    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        names: set[str] = set()
        reached = 0
        for master in self.masters:
            try:
                names.update(
                    str(n)
                    for n in master.client.scan_iter(match=self.keys.lock_pattern(match), count=500)
                )
                reached += 1
            except RedisError:
                continue
        if reached < self.quorum:
            raise BackendUnavailable(
                f"redlock scan: {reached} of {len(self.masters)} masters answered, a majority "
                f"of {self.quorum} is needed"
            )
        for name in sorted(names):
            info = self._inspect(self.keys.key_of_lock(name))
            if info is not None:
                yield info

    def job_record(self, key: str) -> JobRecord | None:
        return self._run(self.job_record_rounds(key))

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        return self._run(self.claim_publish_rounds(key, task_id, ttl))

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        return self._run(self.swap_publish_rounds(key, expect, new, ttl_ms))

    def clear_publish(self, key: str) -> None:
        self._run(self.clear_publish_rounds(key))

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        return self._run(self.count_delivery_rounds(key, window_ms))

    def forget(self, key: str) -> bool:
        payload = self._evalsha("redlock_admin", [self.keys.record(key)], ["delete"])
        return self._any(payload, key, "forget")

    def force_release(self, key: str) -> bool:
        k = self.keys
        payload = self._evalsha(
            "redlock_admin", [k.lock(key), k.signal(key)], ["unlock", SIGNAL_LIFETIME_MS]
        )
        return self._any(payload, key, "force_release")

    def release_grant(self, key: str, fence: int) -> bool:
        """Remove `key`'s lock on every master where it still carries `fence`, in the same
        script that checks it: a grant made since the operator looked is left alone."""
        validate_key(key)
        k = self.keys
        payload = self._evalsha(
            "redlock_admin", [k.lock(key), k.signal(key)], ["judged", SIGNAL_LIFETIME_MS, fence]
        )
        return self._any(payload, key, "release_grant")

    def _any(self, payload: bytes, key: str, what: str) -> bool:
        """Sent to every master; True if any had the key. Raises without a majority."""
        replies = self._run(self._everywhere(payload))
        return any(self._quorum_of(what, replies, key, lambda v: type(v) is int))

    # -- waiting, time, servers -------------------------------------------------------
    def wait_for_release(self, key: str, timeout: float) -> None:
        """Block on one master's signal list until a release pushes it, or `timeout`.

        A release signals on every master where the refused attempt marked the lock as
        waited on; the waiter listens on one of those (`wait_master`). If that master fails,
        the next one is used from the next wait on, and this wait sleeps instead (the
        caller's backoff polls).
        """
        timeout = min(timeout, self._max_block)
        if timeout < 0.001:
            return
        index = self.wait_master(key)
        try:
            self.masters[index].client.blpop([self.keys.signal(key)], timeout=timeout)
        except RedisError:
            self._wait_on = index + 1
            self.clock.sleep(timeout)

    def server_time(self) -> float:
        for master in self.masters:
            try:
                seconds, micros = master.client.time()
            except RedisError:
                continue
            return float(seconds) + float(micros) / 1e6
        raise BackendUnavailable("redlock: no master answered TIME")

    def _ping(self) -> str:
        """PING each master: healthy while a majority answers (grants need one)."""
        return ping_masters(self.masters, self.quorum)

    def security(self) -> Security:
        """TLS and login as configured, the weakest master's (checks.masters_security)."""
        return masters_security(self.masters)

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        # Per master: refuse eviction; warn when one is down or keeps no crash-proof AOF
        # (its fence is then not durable, and the backend's capabilities say so).
        for refuse, problem, fix in self.check_servers():
            yield Finding(refuse, target.setting, problem, fix)

    def check_servers(self) -> list[tuple[bool, str, str]]:
        """What about the masters is unsafe (refuse) or weakens a guarantee (warn).

        Returns (refuse, problem, fix) triples, for the start-up checks. Also sets this
        instance's `capabilities.durable_fence`: true only when every master answered and
        keeps its data through a crash (appendonly yes, appendfsync always).
        """
        found, durable = check_masters(self.masters, self.quorum)
        caps = replace(type(self).capabilities, durable_fence=durable)
        vars(self)["capabilities"] = caps  # this instance's servers, not the class's default
        return found

    def close(self) -> None:
        """Wait briefly for replies still owed (so what was sent has run), then disconnect."""
        deadline = time.monotonic() + min(self.socket_timeout, 1.0)
        for master in self.masters:
            master.close(deadline)

