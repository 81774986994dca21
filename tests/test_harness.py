"""Quick checks that the real-server test harness in tests/servers.py does what it promises."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from devstack import local_cluster, local_sentinel
from devstack.procs import pid_alive
from tests.servers import (
    MARIADB_ADMIN_URL,
    POSTGRES_ADMIN_URL,
    MariaDBDatabase,
    PostgresDatabase,
    ProcessGroup,
    RedisServer,
    free_port,
    wait_for,
)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 1024 <= port <= 65535


def test_wait_for_returns_value_and_times_out() -> None:
    calls: list[int] = []

    def third_time_lucky() -> int:
        calls.append(1)
        return 42 if len(calls) >= 3 else 0

    assert wait_for(third_time_lucky, timeout=2.0, interval=0.001) == 42
    started = time.monotonic()
    with pytest.raises(AssertionError, match="never true"):
        wait_for(lambda: False, timeout=0.05, message=lambda: "never true")
    assert time.monotonic() - started < 1.0


def test_server_starts_and_answers(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    assert redis_client.ping()
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert pid_alive(redis_server.pid)
    config = {
        _text(k): _text(v)
        for k, v in redis_client.config_get("save", "appendonly", "maxmemory-policy", "dir").items()
    }
    assert config == {
        "save": "",
        "appendonly": "no",
        "maxmemory-policy": "noeviction",
        "dir": str(redis_server.workdir),
    }
    assert redis_server.log_path.exists()


def test_redis_url_is_flushed_between_tests_part1(redis_client: redis.Redis) -> None:
    assert redis_client.dbsize() == 0
    redis_client.set("left-over", "1")


def test_redis_url_is_flushed_between_tests_part2(redis_client: redis.Redis) -> None:
    assert redis_client.dbsize() == 0


def test_pause_times_out_and_resume_answers(fresh_redis: RedisServer) -> None:
    client = fresh_redis.client(socket_timeout=0.2, socket_connect_timeout=0.2)
    assert client.ping()
    fresh_redis.pause()
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        client.ping()
    assert time.monotonic() - started < 1.0  # one attempt, no retry backoff
    fresh_redis.resume()
    assert wait_for(lambda: _ping(client), timeout=5.0, message="no PONG after resume")


def _ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_restart_loses_data_and_keeps_port(fresh_redis: RedisServer) -> None:
    client = fresh_redis.client()
    client.set("k", "v")
    port, old_pid = fresh_redis.port, fresh_redis.pid
    fresh_redis.restart()
    assert fresh_redis.port == port
    assert fresh_redis.pid != old_pid
    assert not pid_alive(old_pid)
    assert wait_for(lambda: _ping(client), timeout=5.0, message="client did not reconnect")
    assert client.get("k") is None


def test_kill_then_start_again(fresh_redis: RedisServer) -> None:
    fresh_redis.kill()
    assert not fresh_redis.running
    with pytest.raises(redis.ConnectionError):
        fresh_redis.client(socket_connect_timeout=0.5).ping()
    fresh_redis.start()
    assert fresh_redis.client().ping()


def test_stop_paused_server_exits_and_cleans_up() -> None:
    server = RedisServer().start()
    pid, workdir = server.pid, server.workdir
    server.pause()
    server.stop(timeout=5.0)
    assert not pid_alive(pid)
    assert not workdir.exists()


def test_start_failure_reports_log_tail() -> None:
    server = RedisServer(extra_args=["--no-such-option", "x"], startup_timeout=5.0)
    with pytest.raises(RuntimeError, match="no-such-option"):
        server.start()
    server.stop()


def test_process_group_stops_children(tmp_path: Path) -> None:
    # A parent that spawns a child which ignores SIGTERM: both must be gone afterwards.
    script = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(flush=True); time.sleep(60)'], stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    with ProcessGroup(tmp_path) as group:
        proc = group.spawn([sys.executable, "-c", script], name="parent")
        log = tmp_path / "parent.log"
        child_pid = int(
            wait_for(lambda: log.read_text().strip(), timeout=10.0, message="no child pid")
        )
        assert pid_alive(child_pid)
        group.stop_all(timeout=0.5)
    assert proc.returncode == -signal.SIGTERM
    wait_for(lambda: not pid_alive(child_pid), timeout=5.0, message="child survived")
    assert os.getpgid(os.getpid()) != proc.pid


def test_postgres_database_is_usable(pg_url: str) -> None:
    assert pg_url.startswith("postgresql+psycopg://postgres@127.0.0.1:5432/jobfence_test_")
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id int PRIMARY KEY)"))
            conn.execute(sa.text("INSERT INTO t VALUES (1)"))
            assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one() == 1
            assert conn.execute(sa.text("SELECT current_database()")).scalar_one() in pg_url
            conn.execute(sa.text("DROP TABLE t"))
    finally:
        engine.dispose()


def test_postgres_drop_terminates_open_connections() -> None:
    if (reason := PostgresDatabase.reachable(POSTGRES_ADMIN_URL)) is not None:
        pytest.skip(reason)
    db = PostgresDatabase()
    engine = db.engine()
    conn = engine.connect()
    conn.execute(sa.text("SELECT 1"))
    db.drop()
    admin = sa.create_engine(db.admin_url)
    try:
        with admin.connect() as c:
            found = c.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": db.name}
            ).first()
        assert found is None
    finally:
        admin.dispose()
        with pytest.raises(sa.exc.DBAPIError):
            conn.execute(sa.text("SELECT 1"))
        conn.invalidate()
        engine.dispose()


def test_mariadb_database_is_usable(mariadb_url: str) -> None:
    assert mariadb_url.startswith("mysql+pymysql://root@127.0.0.1:3306/jobfence_test_")
    engine = sa.create_engine(mariadb_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id int PRIMARY KEY)"))
            conn.execute(sa.text("INSERT INTO t VALUES (1)"))
            assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one() == 1
            conn.execute(sa.text("DROP TABLE t"))
    finally:
        engine.dispose()


def test_mariadb_drop_with_open_transaction() -> None:
    if reason := MariaDBDatabase.reachable(MARIADB_ADMIN_URL):
        pytest.skip(reason)
    db = MariaDBDatabase()
    engine = db.engine()
    conn = engine.connect()
    conn.execute(sa.text("CREATE TABLE t (id int PRIMARY KEY) ENGINE=InnoDB"))
    conn.execute(sa.text("INSERT INTO t VALUES (1)"))  # open transaction holds a metadata lock
    db.drop()
    conn.invalidate()
    engine.dispose()


def test_sqlite_url(sqlite_url: str, tmp_path: Path) -> None:
    assert sqlite_url == f"sqlite:///{tmp_path / 'ledger.sqlite'}"


@pytest.fixture
def squat() -> Iterator[Callable[[Any, int], list[int]]]:
    """Hand out a port some other process already listens on as the `nth` port (from 0)
    that `module.free_port()` picks, the real pick otherwise; the ports handed out, in order."""
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken: int = squatter.getsockname()[1]
    patch = pytest.MonkeyPatch()

    def arm(module: Any, nth: int) -> list[int]:
        handed: list[int] = []
        real = module.free_port

        def picked() -> int:
            port = taken if len(handed) == nth else real()
            handed.append(port)
            return port

        patch.setattr(module, "free_port", picked)
        return handed

    try:
        yield arm
    finally:
        patch.undo()
        squatter.close()


def test_a_sentinel_topology_moves_off_a_port_taken_before_it_binds(
    squat: Callable[[Any, int], list[int]],
) -> None:
    """free_port() is racy: another process (a client's ephemeral port) may bind the port
    before the sentinel does. The topology starts again on new ports instead of failing."""
    handed = squat(local_sentinel, 1)  # the master's is the first; the sentinel's the second
    with local_sentinel.LocalSentinel(replicas=0, sentinels=1) as topology:
        taken = handed[1]  # handed out: the collision really happened
        assert len(handed) > 3, handed  # ... and the start was tried again on new ports
        assert topology.sentinels[0].port != taken
        assert topology.master().client().ping()


def test_a_cluster_moves_off_a_bus_port_taken_before_its_node_binds(
    squat: Callable[[Any, int], list[int]],
) -> None:
    """The same race for a port given in a node's arguments (its cluster bus): the group
    stops what started and starts again on new ports."""
    handed = squat(local_cluster, 0)
    with local_cluster.LocalCluster(masters=1) as cluster:
        assert len(handed) > 1, handed  # the taken bus port was handed out, then a new one
        assert handed[0] not in cluster.bus_ports
        assert cluster.client(0).ping()
