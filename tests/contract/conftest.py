"""The `backend` fixture: every contract test runs once per lock backend."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
import pytest

from jobfence.locks import LockBackend, MemoryBackend, RedisBackend
from jobfence.locks.aio import ThreadStore, open_async_store
from jobfence.locks.clock import Clock
from jobfence.locks.drive import AsyncStore, run_async, run_sync
from jobfence.locks.flows import Flow
from tests.servers import POSTGRES_ADMIN_URL, PgBouncer, PostgresDatabase, RedisServer

T = TypeVar("T")

# To add a backend (etcd, postgres, ...), add its name here and a branch to `_harness` that
# builds a BackendHarness: how to open another client (usable in a forked child) and, where
# the server allows it, how to count round trips and how to lose all its data.
BACKENDS = [
    "redis", "memory", "postgres", "mariadb", "etcd", "redlock3", "redlock5", "cluster", "sentinel",
    "zookeeper", "pgbouncer", "valkey",
]


@dataclass
class BackendHarness:
    """A backend under test plus what the contract needs to know about its server."""

    name: str
    backend: LockBackend
    # Opens another client on the same server. None: the backend lives in one process only.
    connect: Callable[[], LockBackend] | None
    # Requests each server (node, master) has handled so far; None if it cannot tell. A
    # call's round trips are the largest growth of any one of them (see round_trips).
    requests: Callable[[], Sequence[int]] | None = None
    # Restarts the server with all its data lost; None if that cannot be done.
    lose_data: Callable[[], None] | None = None
    # The lock URL and the options `connect` opens it with, for the asyncio store on the
    # same keys; None: the backend lives in one process (its async store wraps `backend`).
    url: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    _opened: list[LockBackend] = field(default_factory=list)

    @property
    def multiprocess(self) -> bool:
        return self.connect is not None

    def round_trips(self, call: Callable[[], T]) -> tuple[T, int | None]:
        """call's answer, and the most requests any one server handled for it (the servers
        work in parallel, so that is its round trips); None if the harness cannot tell."""
        if self.requests is None:
            return call(), None
        before = list(self.requests())
        answer = call()
        after = list(self.requests())
        return answer, max(b - a for a, b in zip(before, after, strict=True))

    def another_client(self) -> LockBackend:
        """A second, independent client on the same server (the same object for memory)."""
        if self.connect is None:
            return self.backend
        other = self.connect()
        self._opened.append(other)
        return other

    def open_async(self) -> AsyncStore:
        """The asyncio store a user gets for this server (native where the registry says,
        else a ThreadStore), on the same keys as `backend`."""
        if self.url is None:
            return ThreadStore(self.backend)
        return open_async_store(self.url, **self.options)

    def close(self) -> None:
        for b in [*self._opened, self.backend]:
            b.close()


SCRIPT_ENTRY_POINTS = {f"cmdstat_{c}" for c in ("eval", "evalsha", "eval_ro", "evalsha_ro")}


def _redis_requests(server: RedisServer) -> Callable[[], int]:
    """Script calls the server ran to the end (INFO commandstats counts commands inside
    scripts too; a NOSCRIPT answer is a failed call, and the resend after loading is the one
    that counts)."""
    admin = server.client(decode_responses=True)

    def count() -> int:
        stats = admin.info("commandstats")
        return sum(
            int(v["calls"]) - int(v.get("failed_calls", 0))
            for k, v in stats.items()
            if k in SCRIPT_ENTRY_POINTS
        )

    return count


def _per_server(counters: Sequence[Callable[[], int]]) -> Callable[[], list[int]]:
    return lambda: [count() for count in counters]


def _harness(name: str, request: pytest.FixtureRequest) -> BackendHarness:
    if name in ("redis", "valkey"):  # Valkey: the same backend on valkey-server
        server: RedisServer = request.getfixturevalue(f"fresh_{name}")
        url = server.url

        def connect() -> LockBackend:
            return RedisBackend.from_url(url, prefix="contract")

        def lose_data() -> None:
            server.restart()

        return BackendHarness(
            name=name,
            backend=connect(),
            connect=connect,
            requests=_per_server([_redis_requests(server)]),
            lose_data=lose_data,
            url=url,
            options={"prefix": "contract"},
        )
    if name == "memory":
        return BackendHarness(name=name, backend=MemoryBackend(), connect=None)
    if name == "postgres":
        return _postgres_harness(request)
    if name == "pgbouncer":
        return _postgres_harness(request, bouncer=request.getfixturevalue("pgbouncer"))
    if name == "mariadb":
        return _mariadb_harness(request)
    if name == "etcd":
        return _etcd_harness(request)
    if name.startswith("redlock"):
        return _redlock_harness(int(name.removeprefix("redlock")), request)
    if name == "cluster":
        return _cluster_harness(request)
    if name == "sentinel":
        return _sentinel_harness(request)
    if name == "zookeeper":
        return _zookeeper_harness(request)
    raise AssertionError(f"no contract harness for backend {name!r}")


def _redlock_harness(n: int, request: pytest.FixtureRequest) -> BackendHarness:
    """`n` private masters with the persistence a durable fence needs (AOF, fsync always, on
    tmpfs); losing data crashes every master and starts it empty. A round trip is one
    command to every master in parallel: the most any one master has run."""
    from devstack.redis_masters import RedisMasters
    from jobfence.locks.backends.redlock import RedlockBackend

    started: dict[int, RedisMasters] = request.getfixturevalue("redlock_masters")
    masters = started.get(n)
    if masters is None:  # one set per size for the session: starting 5 servers per test adds up
        masters = started[n] = RedisMasters(n, durable=True).start()
    url = masters.url

    def connect() -> LockBackend:
        return RedlockBackend.from_url(url, prefix="contract")

    backend = connect()
    assert isinstance(backend, RedlockBackend)
    assert backend.check_servers() == []  # and so its fence is durable
    counters = [_redis_requests(server) for server in masters.servers]
    return BackendHarness(
        name=f"redlock{n}",
        backend=backend,
        connect=connect,
        requests=_per_server(counters),
        lose_data=masters.lose_all_data,
        url=url,
        options={"prefix": "contract"},
    )


def _sentinel_harness(request: pytest.FixtureRequest) -> BackendHarness:
    """The session's Sentinel topology (1 master, 2 replicas, 3 sentinels), under a prefix
    of this test's own. Losing data empties the master (FLUSHALL reaches the replicas too,
    SCRIPT FLUSH drops the loaded scripts): a failover onto a replica that never received
    a grant is the fault suite's (tests/faults/test_sentinel_faults.py)."""
    from devstack.local_sentinel import LocalSentinel
    from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend

    started: list[LocalSentinel] = request.getfixturevalue("sentinel_topology")
    if not started:  # one topology for the session, started on first use
        # No contract test fails the master over; a loaded machine (four test workers beside
        # long runs) starved its PINGs past 1 s and the sentinels named a new master mid-race.
        started.append(LocalSentinel(down_after_ms=5000).start())
    topology = started[0]
    topology.wait_ready()
    url = topology.url
    prefix = f"contract-{uuid.uuid4().hex[:8]}"

    def connect() -> LockBackend:
        return RedisSentinelBackend.from_url(url, prefix=prefix)

    master = topology.master()

    def lose_data() -> None:
        admin = master.client()
        admin.flushall()
        admin.script_flush()

    return BackendHarness(
        name="sentinel",
        backend=connect(),
        connect=connect,
        requests=_per_server([_redis_requests(master)]),
        lose_data=lose_data,
        url=url,
        options={"prefix": prefix},
    )


def _mariadb_harness(request: pytest.FixtureRequest) -> BackendHarness:
    """A scratch database on the shared MariaDB; losing data drops every jobfence table,
    the fence counter too (fences then rest on the server clock and the client's floor)."""
    from jobfence.locks.backends.mysql import MySQLBackend
    from tests.servers import MARIADB_ADMIN_URL, MariaDBDatabase

    reason = MariaDBDatabase.reachable(MARIADB_ADMIN_URL)
    if reason:
        pytest.skip(reason)
    db = MariaDBDatabase()
    request.addfinalizer(db.drop)
    url = db.url.replace("mysql+pymysql://", "mariadb://", 1)

    def connect() -> LockBackend:
        return MySQLBackend.from_url(url, prefix="contract")

    first = connect()
    assert isinstance(first, MySQLBackend)
    # Round trips counted at the client: every command PyMySQL sends waits for its reply
    # (a shared server's global counters would count other clients too).
    sent = [0]
    opener = first._pool.connect

    def counting_open() -> Any:
        conn = opener()
        send = conn._execute_command

        def counted(command: int, sql: Any) -> Any:
            sent[0] += 1
            return send(command, sql)

        conn._execute_command = counted
        return conn

    first._pool.connect = counting_open

    def lose_data() -> None:
        tables = ", ".join(first.tables.values())
        engine = db.engine()
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {tables}")
        finally:
            engine.dispose()

    return BackendHarness(
        name="mariadb",
        backend=first,
        connect=connect,
        requests=lambda: [sent[0]],
        lose_data=lose_data,
        url=url,
        options={"prefix": "contract"},
    )


def _etcd_harness(request: pytest.FixtureRequest) -> BackendHarness:
    """The session's etcd, under a prefix of this test's own; losing data restarts it with
    an empty data directory (a new cluster: keys, leases, revisions and the fence base gone).

    No request count: extend_many is a txn plus one keep-alive per lease (etcd has no op
    that does both), so the contract's one-request check does not apply.
    """
    from devstack.local_etcd import EtcdCluster
    from jobfence.locks.backends.etcd import EtcdBackend

    server: EtcdCluster = request.getfixturevalue("etcd_server")
    url: str = request.getfixturevalue("etcd_url")
    prefix = f"contract-{uuid.uuid4().hex[:8]}"

    def connect() -> LockBackend:
        return EtcdBackend.from_url(url, prefix=prefix)

    def lose_data() -> None:
        server.restart(fresh=True)

    return BackendHarness(name="etcd", backend=connect(), connect=connect, lose_data=lose_data,
                          url=url, options={"prefix": prefix})  # fmt: skip


def _postgres_harness(
    request: pytest.FixtureRequest, bouncer: PgBouncer | None = None
) -> BackendHarness:
    """A scratch database per test; data loss drops the lease table and the fence sequence.
    With `bouncer` the backend reaches it through that PgBouncer (transaction pooling, fewer
    server sessions than clients); data loss is still done directly on the server."""
    from jobfence.locks.backends import postgres

    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    db = PostgresDatabase()
    request.addfinalizer(db.drop)
    url = db.url if bouncer is None else bouncer.url_for(db.name)

    def connect() -> LockBackend:
        return postgres.PostgresBackend.from_url(url, prefix="contract")

    def lose_data() -> None:
        with psycopg.connect(db.url.replace("+psycopg", ""), autocommit=True) as admin:
            admin.execute(f"DROP TABLE {postgres.TABLE}")
            admin.execute(f"DROP SEQUENCE {postgres.FENCE_SEQUENCE}")

    backend = postgres.PostgresBackend.from_url(url, prefix="contract")
    name = "postgres" if bouncer is None else "pgbouncer"
    # Round trips counted by the client (each one statement: nothing else crosses the wire).
    return BackendHarness(
        name=name,
        backend=backend,
        connect=connect,
        requests=lambda: [backend.statements],
        lose_data=lose_data,
        url=url,
        options={"prefix": "contract"},
    )


def _zookeeper_harness(request: pytest.FixtureRequest) -> BackendHarness:
    """The session's private ZooKeeper, a chroot per test; data loss restarts the server with
    an empty data directory (the other tests' chroots are made again on their first use).

    No request count: a multi is all or nothing, so extend_many over leases of which one was
    lost costs a second multi (tests/test_zookeeper_backend.py counts the cases)."""
    from devstack.local_zookeeper import ZooKeeperServer
    from jobfence.locks.backends.zookeeper import ZooKeeperBackend

    server: ZooKeeperServer = request.getfixturevalue("zookeeper_server")
    url: str = request.getfixturevalue("zookeeper_url")

    def connect() -> LockBackend:
        return ZooKeeperBackend.from_url(url, prefix="contract")

    return BackendHarness(
        name="zookeeper",
        backend=connect(),
        connect=connect,
        lose_data=lambda: server.restart(fresh=True) and None,
        url=url,
        options={"prefix": "contract"},
    )


def _cluster_harness(request: pytest.FixtureRequest) -> BackendHarness:
    """The session's 3-master cluster under a prefix of this test's own; losing data
    crashes every master and starts it empty (its cluster config kept, so it rejoins). A
    round trip is the most script calls any one node has run (extend_many sends one script
    to every node at once)."""
    from jobfence.locks.backends.redis.cluster import RedisClusterBackend

    cluster = request.getfixturevalue("redis_cluster")
    prefix = f"contract-{uuid.uuid4().hex[:8]}"

    def connect() -> LockBackend:
        return RedisClusterBackend.from_url(cluster.url, prefix=prefix)

    def lose_data() -> None:
        for server in cluster.masters:
            server.restart()
        cluster.wait_ok()

    counters = [_redis_requests(server) for server in cluster.masters]
    return BackendHarness(
        name="cluster",
        backend=connect(),
        connect=connect,
        requests=_per_server(counters),
        lose_data=lose_data,
        url=cluster.url,
        options={"prefix": prefix},
    )


@pytest.fixture(scope="session")
def redlock_masters() -> Iterator[dict[int, Any]]:
    """Redlock masters by their number, started on first use, stopped after the session."""
    started: dict[int, Any] = {}
    yield started
    for masters in started.values():
        masters.stop()


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[PgBouncer]:
    """A private PgBouncer in transaction pooling before the local PostgreSQL, for the
    session (skipped where one cannot be started)."""
    from devstack.local_pgbouncer import unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with PgBouncer() as bouncer:
        yield bouncer


@pytest.fixture(scope="session")
def sentinel_topology() -> Iterator[list[Any]]:
    """The session's Sentinel topology (empty until a test starts it), stopped at the end."""
    started: list[Any] = []
    yield started
    for topology in started:
        topology.stop()


@pytest.fixture(params=BACKENDS)
def harness(request: pytest.FixtureRequest) -> Iterator[BackendHarness]:
    h = _harness(request.param, request)
    yield h
    h.close()


@pytest.fixture
def backend(harness: BackendHarness) -> LockBackend:
    """The LockBackend under test (one per parameter of BACKENDS)."""
    return harness.backend


@dataclass
class StorePair:
    """One backend's two stores on the same keys: `sync` (the backend, driven by run_sync)
    and `aio` (open_async_store's, driven by run_async on one loop kept for the test)."""

    name: str
    sync: LockBackend
    aio: AsyncStore
    clock: Clock
    runner: asyncio.Runner

    def run_sync(self, flow: Flow[T]) -> T:
        return run_sync(flow, self.sync, self.clock)

    def run_async(self, flow: Flow[T]) -> T:
        return self.runner.run(run_async(flow, self.aio, self.clock))

    @property
    def drivers(self) -> tuple[tuple[str, Callable[[Flow[Any]], Any]], ...]:
        """("sync", run) and ("async", run): a test runs the same assertions through each."""
        return (("sync", self.run_sync), ("async", self.run_async))


@pytest.fixture
def stores(harness: BackendHarness) -> Iterator[StorePair]:
    """The backend under test as a sync and an asyncio store (one per parameter of BACKENDS)."""
    runner = asyncio.Runner()
    aio = harness.open_async()
    pair = StorePair(harness.name, harness.backend, aio, harness.backend.clock, runner)
    try:
        yield pair
    finally:
        try:
            if harness.url is not None:  # a wrapped `backend` is closed by the harness
                close: Callable[[], Any] = getattr(aio, "aclose")  # noqa: B009
                runner.run(close())
        finally:
            runner.close()


@pytest.fixture
def multiprocess(harness: BackendHarness) -> BackendHarness:
    """The harness, for tests that need several OS processes on one server."""
    if not harness.multiprocess:
        pytest.skip(f"{harness.name} backend lives in one process")
    return harness


def run_racers(procs: list[Any], go: Any, out: Any, timeout: float = 60.0) -> list[Any]:
    """Start forked racing processes, release them together with `go`, and collect what
    they put on `out` until each says ("done",): ("error", pid, text) fails the test, any
    other message's tail is one record. Every process has exited 0, or is killed."""
    records: list[Any] = []
    try:
        for p in procs:
            p.start()
        go.set()
        done, deadline = 0, time.monotonic() + timeout
        while done < len(procs):
            msg = out.get(timeout=max(0.1, deadline - time.monotonic()))
            if msg[0] == "error":
                pytest.fail(f"racer {msg[1]} failed: {msg[2]}")
            elif msg[0] == "done":
                done += 1
            else:
                records.append(msg[1:])
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return records
