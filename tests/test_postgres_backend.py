"""The PostgreSQL lock backend beyond the contract: URLs, fork, isolation, pruning, CLI, checks."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from jobfence.config.settings import Settings
from jobfence.locks import Busy, Lease, LockBackend, OwnerMeta, open_backend
from jobfence.locks.backends.postgres import PostgresBackend
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase, wait_for


@pytest.fixture
def db() -> Iterator[PostgresDatabase]:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    with PostgresDatabase() as scratch:
        yield scratch


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def backend(db: PostgresDatabase) -> Iterator[PostgresBackend]:
    b = PostgresBackend.from_url(db.url, prefix="pgtest")
    yield b
    b.close()


@pytest.mark.parametrize("scheme", ["postgresql", "postgres", "postgresql+psycopg"])
def test_every_postgres_scheme_opens_the_backend(db: PostgresDatabase, scheme: str) -> None:
    url = scheme + "://" + db.url.split("://", 1)[1]
    assert Settings(lock_url=url).lock_url == url
    backend = open_backend(url, prefix="p", socket_timeout=2.0, fence_retention=60.0)
    try:
        assert isinstance(backend, PostgresBackend)
        lease = backend.try_acquire("k", 5.0)
        assert lease is not None and lease.release()
    finally:
        backend.close()


def test_fences_are_in_the_common_microsecond_space(
    db: PostgresDatabase, backend: PostgresBackend
) -> None:
    with psycopg.connect(_plain(db.url), autocommit=True) as admin:
        row = admin.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1e6)::bigint")
        before = row.fetchone()
    assert before is not None
    lease = backend.try_acquire("space", 5.0)
    assert lease is not None
    assert lease.fence >= before[0], "a fence below the server clock in µs"
    assert lease.release()


def test_busy_answer_names_the_holders_task_and_fingerprint(backend: PostgresBackend) -> None:
    meta = OwnerMeta(host="h", pid=1, task_id="task-1", task_name="t")
    holder = backend.begin("job", 10.0, meta=meta, record=True, fingerprint="fp-a")
    assert isinstance(holder, Lease)
    busy = backend.begin("job", 10.0, record=True, fingerprint="fp-b")
    assert isinstance(busy, Busy)
    assert (busy.task_id, busy.fingerprint) == ("task-1", "fp-a")
    assert 9.0 < busy.ttl_left <= 10.0


def _race(url: str, keys: list[str], threads: int) -> dict[str, list[Any]]:
    """`threads` clients attempt every key at once; the answers per key."""
    clients = [PostgresBackend.from_url(url, prefix="race") for _ in range(threads)]
    answers: dict[str, list[Any]] = {k: [] for k in keys}
    barrier = threading.Barrier(threads)

    def run(client: LockBackend) -> None:
        for key in keys:
            barrier.wait(30)
            try:
                answers[key].append(client.attempt(key, 30.0))
            except Exception as exc:
                answers[key].append(exc)

    workers = [threading.Thread(target=run, args=(c,)) for c in clients]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    for c in clients:
        c.close()
    return answers


def test_racers_on_an_absent_key_always_get_an_answer(db: PostgresDatabase) -> None:
    """The snapshot trap: a loser must get Busy with the winner's TTL, never nothing.

    The database's default isolation is REPEATABLE READ, under which the upsert would fail
    for every racer that waited: the backend's sessions must run READ COMMITTED anyway.
    """
    with psycopg.connect(_plain(POSTGRES_ADMIN_URL), autocommit=True) as admin:
        admin.execute(
            f"ALTER DATABASE \"{db.name}\" SET default_transaction_isolation = 'repeatable read'"
        )
    keys = [f"fresh:{uuid.uuid4().hex[:8]}" for _ in range(30)]
    answers = _race(db.url, keys, threads=6)
    for key, got in answers.items():
        assert len(got) == 6
        assert not [a for a in got if isinstance(a, Exception)], got
        grants = [a for a in got if isinstance(a, Lease)]
        assert len(grants) == 1, f"{key}: {len(grants)} grants"
        for busy in got:
            if isinstance(busy, Busy):
                assert 25.0 < busy.ttl_left <= 30.0


def _child_uses_inherited(backend: PostgresBackend, out: Any) -> None:
    try:
        lease = backend.try_acquire("child", 5.0)
        out.put(("ok", lease is not None and lease.release()))
        backend.close()
    except BaseException as exc:
        out.put(("error", repr(exc)))


def test_a_forked_child_opens_its_own_connections(backend: PostgresBackend) -> None:
    """Celery prefork: a backend built in the parent is used in the child, and vice versa."""
    lease = backend.try_acquire("parent", 10.0)  # the parent has an open connection now
    assert lease is not None
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_uses_inherited, args=(backend, out))
    child.start()
    try:
        assert out.get(timeout=30) == ("ok", True)
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
    # The child neither used nor closed the parent's session.
    assert lease.release()
    assert backend.try_acquire("parent", 1.0) is not None


def test_claim_publish_keeps_the_first_task_until_cleared(backend: PostgresBackend) -> None:
    assert backend.claim_publish("pub", "t1", 30.0) is None
    assert backend.claim_publish("pub", "t1", 30.0) is None  # the same task again
    assert backend.claim_publish("pub", "t2", 30.0) == "t1"
    backend.clear_publish("pub")
    assert backend.claim_publish("pub", "t2", 0.2) is None
    # Free again once its own TTL has passed on the server clock (until then: "t2").
    wait_for(lambda: backend.claim_publish("pub", "t3", 30.0) is None, timeout=10.0)
    assert backend.claim_publish("pub", "t4", 30.0) == "t3"


def test_delivery_count_restarts_after_its_window(backend: PostgresBackend) -> None:
    assert [backend.count_delivery("d", 0.5) for _ in range(3)] == [1, 2, 3]
    time.sleep(0.6)
    assert backend.count_delivery("d", 0.5) == 1


def test_forget_drops_the_record_but_keeps_the_fence(backend: PostgresBackend) -> None:
    lease = backend.begin("f", 10.0, record=True, fingerprint="fp")
    assert isinstance(lease, Lease)
    assert backend.commit(lease, state="DONE", result="1", fingerprint="fp", result_ttl=60)
    assert backend.forget("f") and not backend.forget("f")
    again = backend.begin("f", 10.0, record=True, fingerprint="fp")
    assert isinstance(again, Lease) and again.fence > lease.fence


def test_errors_never_show_the_password(db: PostgresDatabase) -> None:
    url = db.url.replace("postgres@", "postgres:s3cret-pw@").replace(":5432/", ":1/")
    backend = PostgresBackend.from_url(url, socket_timeout=1.0)
    with pytest.raises(Exception) as err:
        backend.try_acquire("k", 1.0)
    assert "s3cret-pw" not in str(err.value)
    assert "BackendUnavailable" in type(err.value).__name__


def _startup_findings(backend: PostgresBackend, url: str) -> list[Any]:
    from jobfence.worker.checks import check_lock_backend

    runtime = SimpleNamespace(settings=Settings(lock_url=url), backend=backend)
    conf = SimpleNamespace(task_always_eager=False)
    return list(check_lock_backend(conf, runtime))  # type: ignore[arg-type]


def test_startup_accepts_a_direct_connection(db: PostgresDatabase) -> None:
    backend = PostgresBackend.from_url(db.url)
    try:
        assert _startup_findings(backend, db.url) == []
    finally:
        backend.close()


def test_startup_refuses_sessions_without_read_committed(db: PostgresDatabase) -> None:
    """As behind a pooler that drops the startup options, on a REPEATABLE READ database."""
    with psycopg.connect(_plain(POSTGRES_ADMIN_URL), autocommit=True) as admin:
        admin.execute(
            f"ALTER DATABASE \"{db.name}\" SET default_transaction_isolation = 'repeatable read'"
        )
    backend = PostgresBackend(_plain(db.url))  # no startup options of its own
    try:
        findings = _startup_findings(backend, db.url)
    finally:
        backend.close()
    assert [f.refuse for f in findings] == [True]
    assert "read committed" in findings[0].problem
    assert findings[0].setting == "JOBFENCE_LOCK_URL"


def test_startup_only_warns_when_the_database_is_down(db: PostgresDatabase) -> None:
    url = db.url.replace(":5432/", ":1/")
    backend = PostgresBackend.from_url(url, socket_timeout=1.0)
    findings = _startup_findings(backend, url)
    assert [f.refuse for f in findings] == [False]
    assert "cannot reach" in findings[0].problem


def _keys(url: str) -> set[str]:
    with psycopg.connect(_plain(url), autocommit=True) as admin:
        return {r[0] for r in admin.execute("SELECT key FROM jobfence_locks")}


def test_prune_drops_rows_unused_for_the_retention_only(db: PostgresDatabase) -> None:
    backend = PostgresBackend.from_url(
        db.url, prefix="prune", fence_retention=0.2, prune_interval=0.25
    )
    try:
        old = backend.try_acquire("old", 5.0)
        assert old is not None and old.release()
        held = backend.try_acquire("held", 0.5)
        done = backend.begin("done", 5.0, record=True)
        assert held is not None and isinstance(done, Lease)
        assert backend.commit(done, state="DONE", result="1", fingerprint="", result_ttl=60)
        time.sleep(0.3)  # past the retention; 'held' still live, 'done' has its record
        assert backend.try_acquire("held", 5.0) is None
        backend.prune()  # or the pass this attempt started in the background
        wait_for(lambda: "old" not in _keys(db.url), timeout=10.0, message="never pruned")
        assert {"held", "done"} <= _keys(db.url)
        again = backend.try_acquire("old", 5.0)
        assert again is not None and again.fence > old.fence
    finally:
        backend.close()


def test_one_prune_pass_per_interval_across_clients(db: PostgresDatabase) -> None:
    a, b = (
        PostgresBackend.from_url(db.url, prefix="turn", prune_interval=3600.0) for _ in range(2)
    )
    try:
        assert a.prune() == 0
        assert a.prune() is None and b.prune() is None
    finally:
        a.close()
        b.close()


def test_a_key_moves_between_redis_and_postgres_with_rising_fences(
    backend: PostgresBackend, redis_url: str
) -> None:
    """One fence space: the PostgreSQL source, made first, still issues above later Redis
    grants (its fence is at least the server clock in µs), and Redis above it."""
    from jobfence.locks import RedisBackend

    on_redis = RedisBackend.from_url(redis_url, prefix="pgtest")
    try:
        fences = []
        for b in (backend, on_redis, backend, on_redis, backend):
            for _ in range(3):
                lease = b.try_acquire("moved", 5.0)
                assert lease is not None
                fences.append(lease.fence)
                assert lease.release()
        assert fences == sorted(set(fences)), fences
    finally:
        on_redis.close()


_CREATORS = "SELECT pg_advisory_lock(hashtextextended(%s, 0))"


@pytest.mark.parametrize("tables", ["leases", "semaphores"])
def test_a_fleet_starting_at_once_never_queues_behind_the_creators_lock(
    db: PostgresDatabase, tables: str
) -> None:
    """Tables already there: a new client's first call takes no DDL lock. (Fifty racers
    starting at once each took it in turn, and the last one's wait ran past its statement
    timeout: "create tables failed ... canceling statement due to statement timeout".)"""
    first = PostgresBackend.from_url(db.url, prefix="pgtest")
    first.create_tables()
    first.create_semaphore_tables()
    first.close()
    lock_name = "jobfence_locks" if tables == "leases" else "jobfence_semaphores"
    with psycopg.connect(_plain(db.url), autocommit=True) as admin:
        admin.execute(_CREATORS, (lock_name,))  # a creator holding its lock for ever
        late = PostgresBackend.from_url(db.url, prefix="pgtest", socket_timeout=0.5)
        try:
            if tables == "leases":
                lease = late.try_acquire("k", 5.0)
                assert lease is not None and lease.release()
            else:
                late.create_semaphore_tables()
        finally:
            late.close()


def test_a_creator_waits_past_its_socket_timeout_for_another_creator(
    db: PostgresDatabase,
) -> None:
    """No tables yet and another session creating them: waiting for its lock is expected,
    so the short per-statement bound gives way (a 0.3 s bound, a 1 s wait)."""
    creator = PostgresBackend.from_url(db.url, prefix="pgtest", socket_timeout=0.3)
    answers: list[object] = []
    with psycopg.connect(_plain(db.url), autocommit=True) as admin:
        admin.execute(_CREATORS, ("jobfence_locks",))
        waiter = threading.Thread(target=lambda: answers.append(creator.try_acquire("k", 5.0)))
        waiter.start()
        # Poll until the creator waits on the lock (pg_locks shows it ungranted).
        wait_for(
            lambda: admin.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            ).fetchone()
            == (1,),
            timeout=10.0,
        )
        time.sleep(1.0)  # the hold this test is about: three socket timeouts
        admin.execute("SELECT pg_advisory_unlock_all()")
        waiter.join(30)
    creator.close()
    assert len(answers) == 1 and isinstance(answers[0], Lease), answers
