"""The MySQL/MariaDB lock backend beyond the contract: URLs, sessions, fork, lock waits."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa
from pymysql.err import MySQLError, OperationalError  # type: ignore[import-untyped]

from jobfence.config import Settings, UnsafeSettings
from jobfence.locks import Busy, JobRecord, LockError, open_backend
from jobfence.locks.backends.mysql import MySQLBackend, key_hash, parse_url
from tests.servers import wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def backend(mariadb_url: str) -> Iterator[MySQLBackend]:
    b = MySQLBackend.from_url(mariadb_url, prefix="mytest")
    yield b
    b.close()


# --------------------------------------------------------------------------- URLs and registry


@pytest.mark.filterwarnings("ignore:JOBFENCE_KEY_SECRET")
@pytest.mark.parametrize("scheme", ["mysql", "mariadb", "mysql+pymysql"])
def test_every_scheme_opens_the_backend_and_passes_settings(scheme: str) -> None:
    url = f"{scheme}://app:p%40ss@db.example:3307/locks"
    assert Settings(lock_url=url).lock_url == url
    backend = open_backend(url, prefix="x", socket_timeout=1.0, fence_retention=60.0)
    assert isinstance(backend, MySQLBackend)  # opening connects nothing yet
    assert parse_url(url) == {
        "host": "db.example",
        "port": 3307,
        "database": "locks",
        "user": "app",
        "password": "p@ss",
    }


def test_a_url_without_database_or_with_an_unknown_option_is_refused() -> None:
    with pytest.raises(UnsafeSettings, match="names no database"):
        Settings(lock_url="mysql://root@127.0.0.1:3306/")
    with pytest.raises(LockError, match="names no database"):
        parse_url("mariadb://root@127.0.0.1")
    with pytest.raises(LockError, match="unknown option 'sslmode'"):
        parse_url("mysql://root@127.0.0.1/db?sslmode=require")
    assert parse_url("mysql://root@h/db?ssl_ca=/ca.pem&ssl_verify_cert=true")["ssl_ca"] == "/ca.pem"


def test_pymysql_is_imported_only_when_asked_for_and_its_absence_names_the_extra() -> None:
    code = (
        "import sys\n"
        "import jobfence.locks\n"
        "assert 'pymysql' not in sys.modules, 'imported eagerly'\n"
        "sys.modules['pymysql'] = None\n"
        "try:\n"
        "    jobfence.locks.open_backend('mysql://root@127.0.0.1/db')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "pip install 'jobfence[mysql]'" in out.stdout


# What MySQL 8 rejects or deprecates, though MariaDB 10.11 accepts it (MySQL 8 itself is not
# installable here: Debian's default-mysql-server is MariaDB).
MARIADB_ONLY = {
    "VALUES(col) in an upsert (deprecated since MySQL 8.0.20)": r"\bVALUES?\s*\(\s*`?\w+`?\s*\)",
    "a row alias (`AS new`, a MariaDB syntax error)": r"\)\s+AS\s+\w+\s+ON\s+DUPLICATE",
    "RETURNING (MariaDB only)": r"\bRETURNING\b",
    "user variables assigned inside expressions (deprecated in MySQL 8.0)": r":=",
    "tx_isolation (removed in MySQL 8.0)": r"\btx_isolation\b",
    "sequences (MariaDB only)": r"\b(NEXTVAL|CREATE\s+SEQUENCE)\b",
    "CREATE OR REPLACE / IF NOT EXISTS on columns and indexes (MariaDB only)": (
        r"\bCREATE\s+OR\s+REPLACE\b|\b(COLUMN|INDEX|KEY)\s+IF\s+NOT\s+EXISTS\b"
    ),
}


def test_every_statement_sent_is_mysql_8_sql_too(
    mariadb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every statement the backend and the advisory lock send, recorded on the wire's way
    out, avoids MariaDB-only syntax: one SQL text for both servers."""
    from pymysql.cursors import Cursor  # type: ignore[import-untyped]

    from jobfence.locks import advisory

    sent: list[str] = []
    recording = [True]
    execute = Cursor.execute

    def record(self: Any, query: str, args: Any = None) -> Any:
        if recording[0]:
            sent.append(query)
        return execute(self, query, args)

    monkeypatch.setattr(Cursor, "execute", record)
    backend = MySQLBackend.from_url(mariadb_url, prefix=f"my8{os.getpid()}")
    try:
        backend.create_tables()
        lease = backend.begin("k8", 5.0, record=True, fingerprint="fp")
        assert not isinstance(lease, (Busy, JobRecord))
        assert isinstance(backend.begin("k8", 5.0, record=True, fingerprint="fp"), Busy)
        backend.extend(lease)
        assert backend.extend_many([lease]) == [True]
        assert backend.inspect("k8") is not None and [i.key for i in backend.scan("k*")] == ["k8"]
        backend.wait_for_release("k8", 0.002)
        assert backend.commit(lease, state="DONE", result="1", fingerprint="fp", result_ttl=60)
        assert isinstance(backend.begin("k8", 5.0, record=True, fingerprint="fp"), JobRecord)
        assert backend.job_record("k8") is not None and backend.forget("k8")
        other = backend.try_acquire("k9", 5.0)
        assert other is not None and backend.force_release("k9")
        again = backend.try_acquire("k9", 5.0)
        assert again is not None and not backend.release_grant("k9", again.fence - 1)
        assert backend.release(again)
        assert backend.claim_publish("k9", "t1", 5.0) is None
        backend.clear_publish("k9")
        assert backend.count_delivery("k9", 5.0) == 1
        backend.purge()
        backend.server_time()
        assert backend.server_problems() == []
    finally:
        backend.close()
    engine = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn, advisory.transaction_lock(conn, "k8", timeout=1.0) as fence:
            assert fence > 0
    finally:
        engine.dispose()
    assert len(sent) > 20
    # SQLAlchemy's probes on each new connection (isolation, variables) are its own and
    # chosen per vendor: they are not ours to check.
    probes = re.compile(r"\s*(SHOW\s|SELECT\s+@@\w+\s*$|SELECT\s+DATABASE\(\)\s*$)", re.I)
    for query in (q for q in sent if not probes.match(q)):
        for what, pattern in MARIADB_ONLY.items():
            assert not re.search(pattern, query, re.IGNORECASE), f"{what}:\n{query}"


# --------------------------------------------------------------------------- sessions


def test_sessions_run_read_committed_on_utc_server_time(backend: MySQLBackend) -> None:
    lease = backend.try_acquire("session:check", 5.0)  # opens a connection
    assert lease is not None
    conn = backend._pool.get()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT @@session.tx_isolation, @@session.time_zone")
            assert cur.fetchone() == ("READ-COMMITTED", "+00:00")
    finally:
        backend._pool.put(conn)
    info = backend.inspect("session:check")
    assert info is not None and abs(info.acquired_at - time.time()) < 5
    assert lease.release()


def test_long_and_non_ascii_keys_are_stored_under_their_hash(backend: MySQLBackend) -> None:
    keys = ["k" * 512, "lager:Grüße/⚙:" + "é" * 400]
    for key in keys:
        lease = backend.try_acquire(key, 5.0)
        assert lease is not None
        info = backend.inspect(key)
        assert info is not None and info.key == key
        assert [i.key for i in backend.scan(key[:10] + "*")] == [key]
        assert lease.release()
    assert key_hash(keys[0]) != key_hash(keys[1]) and len(key_hash(keys[0])) == 64


# --------------------------------------------------------------------------- fork and lock waits


def test_a_forked_child_opens_its_own_connection(backend: MySQLBackend) -> None:
    parent = backend.try_acquire("fork:parent", 10.0)  # the parent's connection is now idle
    assert parent is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: use the inherited backend object, then leave without cleanup
        code = 1
        try:
            child = backend.try_acquire("fork:child", 10.0)
            code = 0 if child is not None and child.fence > parent.fence and child.release() else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(code)
    os.close(write)
    assert os.read(read, 1) == b"\x00"
    os.waitpid(pid, 0)
    os.close(read)
    # The parent's pooled connection was not touched by the child: it still answers.
    backend.extend(parent)
    assert backend.release(parent)


def test_a_lock_wait_timeout_is_retried_until_the_row_is_free(
    backend: MySQLBackend, mariadb_url: str
) -> None:
    lease = backend.try_acquire("wait:row", 30.0)
    assert lease is not None
    engine = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool)
    blocker = engine.connect()
    tx = blocker.begin()
    table = backend.tables["locks"]
    blocker.exec_driver_sql(
        f"SELECT 1 FROM {table} WHERE key_hash = %s FOR UPDATE", (key_hash("wait:row"),)
    )
    timer = threading.Timer(1.6, tx.commit)  # past one lock-wait timeout (1 s), then free
    started = time.monotonic()
    timer.start()
    try:
        backend.extend(lease)  # 1205 after 1 s, retried, then granted
    finally:
        timer.join()
        blocker.close()
        engine.dispose()
    assert time.monotonic() - started >= 1.0
    assert lease.held and lease.release()


def test_a_lock_wait_that_never_ends_fails_as_unavailable(
    backend: MySQLBackend, mariadb_url: str
) -> None:
    from jobfence.locks import BackendUnavailable

    lease = backend.try_acquire("wait:forever", 30.0)
    assert lease is not None
    engine = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool)
    with engine.connect() as blocker, blocker.begin():
        blocker.exec_driver_sql(
            f"SELECT 1 FROM {backend.tables['locks']} WHERE key_hash = %s FOR UPDATE",
            (key_hash("wait:forever"),),
        )
        with pytest.raises(BackendUnavailable) as failed:
            backend.release(lease)
        cause = failed.value.__cause__
        assert isinstance(cause, OperationalError) and cause.args[0] == 1205
    engine.dispose()
    assert backend.release(lease)  # nothing was released by the failed attempts


# --------------------------------------------------------------------------- start-up checks


class _Conf:
    task_always_eager = False


def test_start_up_accepts_the_local_mariadb_and_reports_a_dead_one(mariadb_url: str) -> None:
    from jobfence.tasks import Runtime
    from jobfence.worker.checks import LOCK_SERVER_DOWN, check_lock_backend

    for url, down in [(mariadb_url, False), ("mysql://root@127.0.0.1:1/nothing", True)]:
        runtime = Runtime(Settings(lock_url=url, key_secret="a-real-random-secret-0123456789ab"))
        try:
            findings = list(check_lock_backend(conf=_Conf(), runtime=runtime))
        finally:
            runtime.close()
        assert not [f for f in findings if f.refuse], findings
        assert [f.code for f in findings] == ([LOCK_SERVER_DOWN] if down else [])


def test_server_settings_under_which_no_grant_can_be_written_are_named() -> None:
    from jobfence.locks.backends.mysql import server_problems

    ok = {"version": "10.11.19-MariaDB", "log_bin": True, "binlog_format": "MIXED"}
    assert server_problems(**ok, read_only=False) == []
    assert server_problems(**{**ok, "log_bin": False, "binlog_format": "STATEMENT"},
                           read_only=False) == []  # fmt: skip
    (statement,) = server_problems(**{**ok, "binlog_format": "STATEMENT"}, read_only=False)
    assert "binlog_format=STATEMENT" in statement[0] and "ROW" in statement[1]
    (replica,) = server_problems(**ok, read_only=True)
    assert "read-only" in replica[0] and "primary" in replica[1]


def test_a_connection_the_server_closed_is_replaced_before_use(
    backend: MySQLBackend, mariadb_url: str
) -> None:
    """wait_timeout, a restart or a KILL close idle connections: the next call still works."""
    lease = backend.try_acquire("killed:conn", 30.0)
    assert lease is not None
    (conn,) = backend._pool.idle
    engine = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool)
    with engine.connect() as admin:
        admin.exec_driver_sql(f"KILL CONNECTION {int(conn.thread_id())}")
    engine.dispose()
    wait_for(  # the server's FIN reaches our idle socket: it reads as ready (EOF)
        lambda: select.select([conn._sock], [], [], 0)[0],
        timeout=10.0,
        message="the killed connection's socket never saw the server close it",
    )
    backend.extend(lease)  # not BackendUnavailable, and not a lost lease
    assert conn not in backend._pool.idle
    assert lease.release()


# --------------------------------------------------------------------------- one fence space


def test_a_deployment_moves_between_redis_and_mariadb_without_resetting_its_guards(
    redis_url: str, mariadb_url: str
) -> None:
    """Fences of both backends live in one space (server µs): a guard that accepted one
    backend's tokens accepts the other's next grant, both ways, and still refuses old ones."""
    from jobfence.locks import RedisBackend, SqlFenceGuard, StaleFence

    redis_backend = RedisBackend.from_url(redis_url, prefix="move")
    mysql_backend = MySQLBackend.from_url(mariadb_url, prefix="move")
    engine = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool)
    guard = SqlFenceGuard()
    resource = f"account:{os.getpid()}:{time.monotonic_ns()}"

    def write(fence: int) -> None:
        with engine.begin() as conn:
            guard.check_and_advance(conn, resource, fence)

    fences = []
    try:
        for b in (redis_backend, mysql_backend, redis_backend, mysql_backend, redis_backend):
            lease = b.try_acquire("move:account", 5.0)
            assert lease is not None, b.name
            write(lease.fence)  # accepted: above every token of the other backend
            fences.append(lease.fence)
            assert lease.release()
        for old in fences[:-1]:
            with pytest.raises(StaleFence):
                write(old)
    finally:
        redis_backend.close()
        mysql_backend.close()
        engine.dispose()
    assert fences == sorted(set(fences))
    assert fences[0] > 1_700_000_000 * 10**6  # server microseconds, not a small counter


# --------------------------------------------------------------------------- a server crash


class _PrivateMariaDB:
    """A mariadbd of this test only (own datadir and port), free to kill -9 and restart."""

    def __init__(self, root: Path) -> None:
        import shutil

        from tests.servers import free_port

        if not (shutil.which("mariadbd") or Path("/usr/sbin/mariadbd").exists()):
            pytest.skip("mariadbd not installed")
        self.root = root
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={root / 'data'}",
             "--auth-root-authentication-method=normal", "--skip-test-db", "--user=root"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"mariadb://root@127.0.0.1:{self.port}/locks"

    def start(self) -> None:

        binary = "/usr/sbin/mariadbd" if Path("/usr/sbin/mariadbd").exists() else "mariadbd"
        self.proc = subprocess.Popen(
            [binary, "--no-defaults", f"--datadir={self.root / 'data'}", f"--port={self.port}",
             "--bind-address=127.0.0.1", f"--socket={self.root / 'sock'}", "--user=root",
             f"--pid-file={self.root / 'pid'}", "--skip-log-bin",
             "--innodb-buffer-pool-size=16M", f"--log-error={self.root / 'err.log'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

        def up() -> bool:
            try:
                pymysql.connect(host="127.0.0.1", port=self.port, user="root").close()
                return True
            except MySQLError:
                return False

        try:
            wait_for(up, timeout=120.0, message="private mariadbd did not start")
        except BaseException:
            self.stop()  # never leave our own server running behind a failed start
            raise

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no clean shutdown, InnoDB recovers from its redo log
        self.proc.wait(30)

    def stop(self) -> None:
        from tests.servers import stop_process

        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc, timeout=20.0)


@pytest.fixture
def private_mariadb(tmp_path: Path) -> Iterator[_PrivateMariaDB]:
    server = _PrivateMariaDB(tmp_path)
    server.start()
    conn = pymysql.connect(host="127.0.0.1", port=server.port, user="root")
    with conn.cursor() as cur:
        cur.execute("CREATE DATABASE locks")
    conn.close()
    try:
        yield server
    finally:
        server.stop()


def test_kill_9_of_the_server_keeps_leases_records_and_fence_order(
    private_mariadb: _PrivateMariaDB,
) -> None:
    backend = MySQLBackend.from_url(private_mariadb.url, socket_timeout=2.0)
    other = MySQLBackend.from_url(private_mariadb.url, socket_timeout=2.0)
    try:
        fences = []
        for _ in range(50):
            lease = backend.try_acquire("crash:cycle", 30.0)
            assert lease is not None
            fences.append(lease.fence)
            assert lease.release()
        held = backend.try_acquire("crash:held", 60.0)
        job = backend.begin("crash:job", 30.0, record=True, fingerprint="fp")
        assert held is not None and not isinstance(job, Busy | JobRecord)
        assert backend.commit(job, state="DONE", result='"paid"', fingerprint="fp", result_ttl=600)

        private_mariadb.kill()
        private_mariadb.start()

        # Every acknowledged grant and record survived: the held lease is still its
        # holder's (another client is refused, the holder extends it over a new connection).
        busy = other.attempt("crash:held", 5.0)
        assert isinstance(busy, Busy)
        backend.extend(held)
        done = other.begin("crash:job", 5.0, record=True, fingerprint="fp")
        assert isinstance(done, JobRecord) and (done.result, done.fence) == ('"paid"', job.fence)
        # ... and fences keep increasing after the crash, from a client that never saw one.
        after = other.try_acquire("crash:cycle", 5.0)
        assert after is not None and after.fence > max(fences[-1], held.fence, job.fence)
        assert after.release() and held.release()
    finally:
        backend.close()
        other.close()
