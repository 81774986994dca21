"""jobfence.tasks.django on real SQLite, PostgreSQL and MariaDB through Django's connections.

Django is configured once in this process (``settings.configure``) with three databases:
``default`` (SQLite), ``pg`` and ``maria``, each a scratch database migrated with the app's
own migration. The settings hold no JOBFENCE_* name, so other tests' ``Settings()`` see
nothing from here; tests that set one use ``override_settings``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

django = pytest.importorskip("django")

from django.conf import settings as django_settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections, transaction  # noqa: E402
from django.test import override_settings  # noqa: E402

from jobfence.config import Settings, UnsafeSettings, load_settings  # noqa: E402
from jobfence.config.django_source import UnknownDjangoSetting  # noqa: E402
from jobfence.locks import CommitOutcomeUnknown, LockError, StaleFence  # noqa: E402
from jobfence.tasks import IdempotencyConflict, JobContext  # noqa: E402
from tests.pg_cut import CommitReplyCutter, kill_session  # noqa: E402
from tests.servers import (  # noqa: E402
    MARIADB_ADMIN_URL,
    POSTGRES_ADMIN_URL,
    MariaDBDatabase,
    PostgresDatabase,
)
from tests.tasks.conftest import job_with_fence as job  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
ALIASES = ["default", "pg", "maria"]
#: The proxy under the "pg_cut" alias (one, made with the databases).
CUTTERS: list[CommitReplyCutter] = []


def _mysql_through_pymysql() -> None:
    """Django's MySQL backend wants mysqlclient (a C build); PyMySQL stands in for the tests."""
    import pymysql

    pymysql.install_as_MySQLdb()
    pymysql.version_info = (2, 2, 1, "final", 0)  # Django checks mysqlclient's version


@pytest.fixture(scope="module")
def databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    if django_settings.configured:
        pytest.skip("Django is already configured in this process")
    servers = ((PostgresDatabase, POSTGRES_ADMIN_URL), (MariaDBDatabase, MARIADB_ADMIN_URL))
    for cls, admin in servers:
        reason = cls.reachable(admin)
        if reason is not None:
            pytest.skip(reason)
    _mysql_through_pymysql()
    pg, maria = PostgresDatabase(), MariaDBDatabase()
    cutter = CommitReplyCutter(5432)
    CUTTERS.append(cutter)
    folder = tmp_path_factory.mktemp("django")
    sqlite = folder / "db.sqlite3"
    django_settings.configure(
        INSTALLED_APPS=["jobfence.tasks.django"],
        USE_TZ=True,
        LOGGING_CONFIG=None,  # leave the test session's logging alone
        DATABASES={
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(sqlite)},
            # Left unmigrated: test_migrate_keeps_tables_the_sqlalchemy_side_created.
            "pre": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(folder / "pre.sqlite3")},
            "pg": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": pg.name,
                "USER": "postgres",
                "HOST": "127.0.0.1",
                "PORT": "5432",
            },
            # The pg database again, through a proxy that can lose a COMMIT's reply.
            "pg_cut": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": pg.name,
                "USER": "postgres",
                "HOST": "127.0.0.1",
                "PORT": str(cutter.port),
                "OPTIONS": {"sslmode": "disable"},
            },
            "maria": {
                "ENGINE": "django.db.backends.mysql",
                "NAME": maria.name,
                "USER": "root",
                "HOST": "127.0.0.1",
                "PORT": "3306",
                "OPTIONS": {"charset": "utf8mb4"},
            },
        },
    )
    django.setup()
    try:
        for alias in ALIASES:
            call_command("migrate", database=alias, verbosity=0)
            with connections[alias].cursor() as cur:
                cur.execute("CREATE TABLE dj_effects (job VARCHAR(64) NOT NULL, fence BIGINT)")
        yield ALIASES
    finally:
        connections.close_all()
        cutter.close()
        pg.drop()
        maria.drop()


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest, databases: list[str]) -> str:
    return str(request.param)



def _new(prefix: str) -> str:
    return f"{prefix}:{uuid.uuid4().hex[:12]}"


def _effects(alias: str, key: str) -> list[int]:
    with connections[alias].cursor() as cur:
        cur.execute("SELECT fence FROM dj_effects WHERE job = %s ORDER BY fence", [key])
        return [int(r[0]) for r in cur.fetchall()]


def _effect(alias: str, key: str, fence: int) -> None:
    with connections[alias].cursor() as cur:
        cur.execute("INSERT INTO dj_effects (job, fence) VALUES (%s, %s)", [key, fence])


def _run(alias: str, j: JobContext, resource: str) -> Any:
    from jobfence.tasks.django import django_effects

    with django_effects.transaction(j, resource, using=alias) as tx:
        if tx.done:
            return tx.result
        _effect(alias, j.key, j.fence)
        tx.result = {"fence": j.fence}
    return tx.result


# --------------------------------------------------------------------------- settings


def test_settings_read_jobfence_names_from_django_settings(databases: list[str]) -> None:
    with override_settings(JOBFENCE_LOCK_URL="redis://127.0.0.1:6390/3", JOBFENCE_DEFAULT_TTL=12):
        s = Settings()
    assert (s.lock_url, s.default_ttl) == ("redis://127.0.0.1:6390/3", 12.0)
    assert Settings().lock_url == Settings.model_fields["lock_url"].default


def test_environment_wins_over_django_settings_and_arguments_over_both(
    databases: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBFENCE_LOCK_URL", "redis://127.0.0.1:6391/0")
    with override_settings(JOBFENCE_LOCK_URL="redis://127.0.0.1:6390/3", JOBFENCE_DEFAULT_TTL=12):
        assert Settings().lock_url == "redis://127.0.0.1:6391/0"
        assert Settings().default_ttl == 12.0  # not in the environment: Django's value
        assert Settings(lock_url="memory://").lock_url == "memory://"


def test_unknown_jobfence_name_in_django_settings_warns(databases: list[str]) -> None:
    with (
        override_settings(JOBFENCE_DEFAULT_TLL=5),
        pytest.warns(UnknownDjangoSetting, match="JOBFENCE_DEFAULT_TLL"),
    ):
        Settings()


def test_bad_django_setting_is_named_by_load_settings_and_manage_check(
    databases: list[str],
) -> None:
    from jobfence.tasks.django.apps import check_settings

    with override_settings(JOBFENCE_DEFAULT_TTL=-1):
        with pytest.raises(UnsafeSettings, match="JOBFENCE_DEFAULT_TTL"):
            load_settings()
        [error] = check_settings()
    # Outside `manage.py check` a warning, so migrate and runserver keep working (the
    # check command's Error: tests/test_django_setup.py).
    assert error.id == "jobfence.W001" and "JOBFENCE_DEFAULT_TTL" in error.msg
    assert "workers and beat refuse to start with it" in error.msg
    assert check_settings() == []


def test_import_jobfence_and_settings_never_import_django() -> None:
    # (kombu.utils.json imports django.utils.functional when Django is installed: not ours.)
    code = (
        "import sys, jobfence, jobfence.tasks, jobfence.worker\n"
        "jobfence.Settings()\n"
        "bad = ('django.conf', 'django.db', 'django.apps', 'jobfence.tasks.django')\n"
        "assert not [m for m in bad if m in sys.modules], [m for m in bad if m in sys.modules]\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_a_django_settings_module_that_fails_to_load_is_named() -> None:
    code = (
        "from jobfence.config import Settings, UnsafeSettings\n"
        "try:\n"
        "    Settings()\n"
        "except UnsafeSettings as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "no_such_project.settings"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("DJANGO_SETTINGS_MODULE: ")
    assert "no_such_project" in done.stdout and "unset DJANGO_SETTINGS_MODULE" in done.stdout


# --------------------------------------------------------------------------- the guard


def test_guard_accepts_equal_refuses_lower_and_rolls_the_write_back(alias: str) -> None:
    from jobfence.tasks.django import fence_guard

    r, key = _new("res"), _new("job")
    for fence in (5, 5, 1_795_271_197_229_967):
        with fence_guard.transaction(r, fence, using=alias):
            _effect(alias, key, fence)
    with pytest.raises(StaleFence) as refused, transaction.atomic(using=alias):
        _effect(alias, key, 7)  # written first, then the check: the block must roll it back
        fence_guard.check_and_advance(r, 7, using=alias)
    assert (refused.value.fence, refused.value.last) == (7, 1_795_271_197_229_967)
    assert _effects(alias, key) == [5, 5, 1_795_271_197_229_967]
    assert fence_guard.last(r, using=alias) == 1_795_271_197_229_967


def test_guard_outside_an_atomic_block_is_refused(alias: str) -> None:
    from jobfence.tasks.django import fence_guard

    with pytest.raises(LockError, match=r"transaction\.atomic"):
        fence_guard.check_and_advance(_new("res"), 1, using=alias)
    with pytest.raises(LockError, match="fence must be an int"), transaction.atomic(using=alias):
        fence_guard.check_and_advance(_new("res"), -1, using=alias)


# --------------------------------------------------------------------------- the effects


def test_effect_and_done_row_commit_once_and_replay_the_result(alias: str) -> None:
    from jobfence.tasks.django import django_effects

    key, r = _new("job"), _new("payment")
    assert _run(alias, job(key, 10), r) == {"fence": 10}
    assert _run(alias, job(key, 11), r) == {"fence": 10}  # a later execution: stored result
    assert _effects(alias, key) == [10]
    row = django_effects.record(key, using=alias)
    assert row is not None and (row["state"], int(row["fence"])) == ("DONE", 10)


def test_same_key_other_arguments_is_a_conflict(alias: str) -> None:
    key, r = _new("job"), _new("payment")
    _run(alias, job(key, 10), r)
    with pytest.raises(IdempotencyConflict):
        _run(alias, job(key, 12, fingerprint="other"), r)


def test_stale_fence_writes_neither_effect_nor_done_row(alias: str) -> None:
    from jobfence.tasks.django import django_effects

    r = _new("payment")
    _run(alias, job(_new("job"), 20), r)
    stale = job(_new("job"), 19)
    with pytest.raises(StaleFence):
        _run(alias, stale, r)
    assert _effects(alias, stale.key) == []
    assert django_effects.record(stale.key, using=alias) is None


def test_a_failing_body_leaves_nothing_and_the_job_runs_again(alias: str) -> None:
    from jobfence.tasks.django import django_effects

    key, r = _new("job"), _new("payment")
    with pytest.raises(RuntimeError), django_effects.transaction(job(key, 3), r, using=alias):
        _effect(alias, key, 3)
        raise RuntimeError("card declined")
    assert _effects(alias, key) == [] and django_effects.record(key, using=alias) is None
    assert _run(alias, job(key, 4), r) == {"fence": 4}


def test_nested_in_an_outer_atomic_block_commits_with_it(alias: str) -> None:
    from jobfence.tasks.django import django_effects

    key, r = _new("job"), _new("payment")
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        _run(alias, job(key, 8), r)
        raise RuntimeError("the caller's own transaction fails later")
    assert _effects(alias, key) == [] and django_effects.record(key, using=alias) is None


def test_racing_executions_of_one_job_take_effect_once(alias: str) -> None:
    """Eight threads (eight connections) run one job with mixed fences at once."""
    key, r = _new("job"), _new("payment")
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def execute(fence: int) -> None:
        try:
            barrier.wait(timeout=30)
            _run(alias, job(key, fence), r)
            outcomes.append("ok")
        except StaleFence:
            outcomes.append("stale")
        except Exception as exc:  # a PK collision is allowed: it rolled back
            outcomes.append(type(exc).__name__)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=execute, args=(100 + i % 4,)) for i in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert len(_effects(alias, key)) == 1, outcomes
    assert set(outcomes) <= {"ok", "stale", "IntegrityError"}, outcomes
    assert "ok" in outcomes


def test_migrate_keeps_tables_the_sqlalchemy_side_created(databases: list[str]) -> None:
    """A project that used SqlEffects first: migrate adopts its tables instead of failing."""
    import sqlalchemy as sa

    from jobfence.tasks import SqlEffects

    engine = sa.create_engine(f"sqlite:///{connections['pre'].settings_dict['NAME']}")
    SqlEffects(engine).create_schema()
    engine.dispose()
    call_command("migrate", "jobfence", database="pre", verbosity=0)
    with connections["pre"].cursor() as cur:
        cur.execute("CREATE TABLE dj_effects (job VARCHAR(64) NOT NULL, fence BIGINT)")
    assert _run("pre", job("pre-job", 1), "payment:pre") == {"fence": 1}
    assert _run("pre", job("pre-job", 2), "payment:pre") == {"fence": 1}


# --------------------------------------------------------------------------- outer transactions


@pytest.fixture
def charge(databases: list[str], redis_url: str) -> Iterator[Any]:
    """A task as the README's, on the PostgreSQL alias and a real Redis lock server; `runs`
    counts its bodies, `runtime` is its jobfence runtime."""
    from celery import Celery

    from jobfence.tasks import install, singleton_task
    from jobfence.tasks.django import django_effects

    app = Celery(_new("outer").replace(":", "-"), set_as_current=False)
    app.conf.update(
        task_always_eager=False,
        task_eager_propagates=True,
        broker_url="memory://localhost/",
        result_backend=None,
    )
    runtime = install(app, Settings(lock_url=redis_url))
    runs: list[int] = []

    # A name of its own: Celery shares every app's tasks with apps made later (shared=True),
    # and a second callable under one name is refused with a DuplicateTaskNameWarning there.
    @singleton_task(app=app, bind=True, key=["payment_id"], name=_new("charge").replace(":", "-"))
    def charge(self: Any, payment_id: str, amount: int) -> Any:
        runs.append(self.job.fence)
        with django_effects.transaction(self.job, f"payment:{payment_id}", using="pg") as tx:
            if tx.done:
                return tx.result
            _effect("pg", payment_id, self.job.fence)
            tx.result = {"charged": amount}
        return tx.result

    charge.runs = runs
    charge.runtime = runtime
    yield charge
    runtime.close()
    app.close()


def _call(task: Any, how: str, *args: Any) -> Any:
    """The task run in this process: called directly, `.apply()`, or `.delay()` eagerly."""
    if how == "direct":
        return task(*args)
    if how == "apply":
        return task.apply(args=args).get()
    task.app.conf.task_always_eager = True
    try:
        return task.delay(*args).get()
    finally:
        task.app.conf.task_always_eager = False


@pytest.mark.parametrize("how", ["direct", "apply", "eager"])
def test_a_task_in_an_outer_atomic_that_rolls_back_leaves_no_record_and_runs_again(
    charge: Any, how: str
) -> None:
    pay = _new("pay")
    with pytest.raises(RuntimeError), transaction.atomic(using="pg"):
        assert _call(charge, how, pay, 5) == {"charged": 5}
        assert _call(charge, how, pay, 5) == {"charged": 5}  # replays the block's DONE row
        raise RuntimeError("the view fails after the charge")
    assert _effects("pg", pay) == []  # rolled back with the caller's transaction
    key, _ = charge.identity((pay, 5), {})
    assert charge.runtime.backend.job_record(key) is None  # ... and so is the record
    assert _call(charge, how, pay, 5) == {"charged": 5}  # runs again, and charges once
    assert len(charge.runs) == 3
    assert _effects("pg", pay) == [charge.runs[2]]


def test_a_task_in_an_outer_atomic_that_commits_records_done_and_replays(charge: Any) -> None:
    pay = _new("pay")
    with transaction.atomic(using="pg"):
        assert charge(pay, 7) == {"charged": 7}
        key, _ = charge.identity((pay, 7), {})
        assert charge.runtime.backend.job_record(key) is None  # not before the commit
    record = charge.runtime.backend.job_record(key)
    assert record is not None and record.state == "DONE"
    assert charge(pay, 7) == {"charged": 7}  # the lock server's record answers
    assert len(charge.runs) == 1 and len(_effects("pg", pay)) == 1


def test_a_second_call_inside_the_same_outer_atomic_replays_its_done_row(charge: Any) -> None:
    pay = _new("pay")
    with transaction.atomic(using="pg"):
        assert charge(pay, 3) == {"charged": 3}
        assert charge(pay, 3) == {"charged": 3}  # not a duplicate of itself: the row answers
    assert len(charge.runs) == 2 and len(_effects("pg", pay)) == 1


def test_a_copy_meeting_the_open_outer_transaction_waits_for_it_then_replays(
    charge: Any,
) -> None:
    """Another worker (thread, connection) runs the job while the caller's transaction is
    open: the fence row's lock holds it until the commit, then it finds the DONE row."""
    pay = _new("pay")
    got: list[Any] = []
    started = threading.Event()

    def copy() -> None:
        try:
            started.set()
            got.append(charge(pay, 4))
        except BaseException as exc:
            got.append(exc)
        finally:
            connections.close_all()

    with transaction.atomic(using="pg"):
        assert charge(pay, 4) == {"charged": 4}
        other = threading.Thread(target=copy)
        other.start()
        started.wait(10)
        # The copy's body starts, then blocks on the fence row this transaction holds.
        _wait_for_lock_wait("pg")
        assert got == []
    other.join(30)
    assert got == [{"charged": 4}]
    assert len(_effects("pg", pay)) == 1


def test_a_body_that_commits_its_own_outer_block_records_done_at_once(
    charge: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's case: the body's own atomic block is the outer one, committed before the
    body returns, so the record is stored as usual, with the job's own lease."""
    body = charge.run

    @functools.wraps(body)  # the same signature: the key binds `payment_id`
    def in_a_block(*args: Any, **kwargs: Any) -> Any:
        with transaction.atomic(using="pg"):
            return body(*args, **kwargs)

    monkeypatch.setattr(charge, "run", in_a_block)
    pay = _new("pay")
    assert charge(pay, 2) == {"charged": 2}
    key, _ = charge.identity((pay, 2), {})
    record = charge.runtime.backend.job_record(key)
    assert record is not None and record.state == "DONE"
    assert record.fence == charge.runs[0]  # committed under the body's lease, no new grant
    assert len(_effects("pg", pay)) == 1


def _wait_for_lock_wait(alias: str, timeout: float = 30.0) -> None:
    """Until another session of this database waits on a row lock."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connections[alias].cursor() as cur:
            cur.execute("SELECT pg_stat_clear_snapshot()")  # else one snapshot per transaction
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            if cur.fetchone()[0]:
                return
        time.sleep(0.05)
    raise AssertionError("no session waited on the open transaction's row lock")


# --------------------------------------------------------------------------- COMMIT lost


def _kill_at_next_commit(alias: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Terminate the alias's server process just before its next COMMIT is sent."""
    import sqlalchemy as sa

    conn = connections[alias]
    real = conn._commit
    killed: list[int] = []

    def commit() -> Any:
        if not killed:
            pid = conn.connection.info.backend_pid
            admin = sa.create_engine(POSTGRES_ADMIN_URL)
            try:
                with admin.connect() as other:  # waits until the process is gone
                    other.execute(sa.text("SELECT pg_terminate_backend(:p, 10000)"), {"p": pid})
            finally:
                admin.dispose()
            killed.append(pid)
        return real()

    monkeypatch.setattr(conn, "_commit", commit)
    return killed


def test_effects_whose_commit_never_landed_raise_outcome_unknown_and_run_again_once(
    databases: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobfence.tasks.django import django_effects

    key, r = _new("job"), _new("payment")
    killed = _kill_at_next_commit("pg", monkeypatch)
    with pytest.raises(CommitOutcomeUnknown, match="did not land"):
        _run("pg", job(key, 5), r)
    assert killed and _effects("pg", key) == []
    assert django_effects.record(key, using="pg") is None
    assert _run("pg", job(key, 6), r) == {"fence": 6}  # the redelivery takes effect once
    assert _effects("pg", key) == [6]


def test_effects_whose_commit_landed_with_its_reply_lost_return_the_result(
    databases: list[str],
) -> None:
    key, r = _new("job"), _new("payment")
    connections["pg_cut"].ensure_connection()
    cutter = CUTTERS[-1]
    cutter.armed.set()
    assert _run("pg_cut", job(key, 7), r) == {"fence": 7}  # settled: the DONE row is there
    assert cutter.fired.is_set()
    assert _effects("pg", key) == [7]
    assert _run("pg", job(key, 8), r) == {"fence": 7}  # and it answers later deliveries


def test_guard_transaction_lost_at_commit_raises_outcome_unknown(
    databases: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobfence.tasks.django import fence_guard

    r = _new("stock")
    _kill_at_next_commit("pg", monkeypatch)
    with pytest.raises(CommitOutcomeUnknown), fence_guard.transaction(r, 3, using="pg"):
        _effect("pg", r, 3)
    assert _effects("pg", r) == []


# ------------------------------------------------------- lost inside the atomic block

#: Each statement of the effect's block (words of its SQL, quoted by the vendor), in order.
EFFECT_STATEMENTS = [
    "INSERT jobfence_fences",  # the fence check-and-advance
    "SELECT jobfence_jobs",  # the DONE row's look-up
    "INSERT dj_effects",  # the body's own write
    "INSERT jobfence_jobs",  # the DONE row
]
ADMIN_URLS = {"pg": POSTGRES_ADMIN_URL, "maria": MARIADB_ADMIN_URL}


@contextlib.contextmanager
def _killing_at(alias: str, statement: str) -> Iterator[list[str]]:
    """Kill the alias's server session just before the first statement whose SQL holds every
    word of `statement` (pg_terminate_backend, or KILL on MariaDB); the list says it fired."""
    import sqlalchemy as sa

    fired: list[str] = []
    admin = sa.create_engine(ADMIN_URLS[alias])

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not fired and all(word in sql for word in statement.split()):
            fired.append(sql)
            kill_session(admin, context["connection"].connection)
        return execute(sql, params, many, context)

    try:
        with connections[alias].execute_wrapper(wrapper):
            yield fired
    finally:
        admin.dispose()


@pytest.mark.parametrize("statement", EFFECT_STATEMENTS)
@pytest.mark.parametrize("server", ["pg", "maria"])
def test_effects_lost_at_any_statement_raise_outcome_unknown_and_run_again_once(
    databases: list[str], server: str, statement: str
) -> None:
    from jobfence.tasks.django import django_effects

    key, r = _new("job"), _new("payment")
    with (
        _killing_at(server, statement) as fired,
        pytest.raises(CommitOutcomeUnknown, match="before its COMMIT: nothing committed"),
    ):
        _run(server, job(key, 5), r)
    assert fired
    assert _effects(server, key) == [] and django_effects.record(key, using=server) is None
    assert _run(server, job(key, 6), r) == {"fence": 6}  # the redelivery takes effect once
    assert _effects(server, key) == [6]
    assert _run(server, job(key, 7), r) == {"fence": 6}  # and its DONE row answers


def test_effects_lost_inside_an_outer_atomic_block_raise_outcome_unknown(
    databases: list[str],
) -> None:
    key, r = _new("job"), _new("payment")
    with (
        _killing_at("pg", "INSERT dj_effects") as fired,
        pytest.raises(CommitOutcomeUnknown, match="nothing committed"),
        transaction.atomic(using="pg"),
    ):
        _run("pg", job(key, 5), r)
    assert fired and _effects("pg", key) == []
    assert _run("pg", job(key, 6), r) == {"fence": 6}


@pytest.mark.parametrize("server", ["pg", "maria"])
def test_guard_transaction_lost_inside_raises_outcome_unknown(
    databases: list[str], server: str
) -> None:
    from jobfence.tasks.django import fence_guard

    r = _new("stock")
    with (
        _killing_at(server, "INSERT dj_effects") as fired,
        pytest.raises(CommitOutcomeUnknown, match="nothing committed"),
        fence_guard.transaction(r, 3, using=server),
    ):
        _effect(server, r, 3)
    assert fired and _effects(server, r) == []
    with fence_guard.transaction(r, 4, using=server):  # the next delivery writes once
        _effect(server, r, 4)
    assert _effects(server, r) == [4]


def test_a_users_own_integrity_error_in_effects_stays_a_failure(alias: str) -> None:
    from django.db import IntegrityError

    from jobfence.tasks.django import django_effects

    key = _new("job")
    with (
        pytest.raises(IntegrityError),
        django_effects.transaction(job(key, 5), key, using=alias),
        connections[alias].cursor() as cur,
    ):
        cur.execute("INSERT INTO dj_effects (job, fence) VALUES (NULL, 5)")  # a NOT NULL broken
    assert django_effects.record(key, using=alias) is None


def test_effects_whose_session_times_out_idle_before_commit_raise_outcome_unknown(
    databases: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server ends the idle session before COMMIT (IdleInTransactionSessionTimeout,
    Django's InternalError): the block did not land, and the job runs again once."""
    import time

    from jobfence.tasks.django import django_effects

    conn = connections["pg"]
    real = conn._commit
    pids: list[int] = []

    def commit() -> Any:
        if pids:
            pid, deadline = pids.pop(), time.monotonic() + 30
            while _session_alive(pid):
                assert time.monotonic() < deadline, "the session was never timed out"
                time.sleep(0.02)
        return real()

    monkeypatch.setattr(conn, "_commit", commit)
    key, r = _new("job"), _new("payment")
    with (
        pytest.raises(CommitOutcomeUnknown, match="did not land"),
        django_effects.transaction(job(key, 5), r, using="pg") as tx,
    ):
        with conn.cursor() as cur:
            cur.execute("SET LOCAL idle_in_transaction_session_timeout = 50")
        pids.append(conn.connection.info.backend_pid)
        _effect("pg", key, 5)
        tx.result = {"fence": 5}
    assert _effects("pg", key) == []
    assert _run("pg", job(key, 6), r) == {"fence": 6}
    assert _effects("pg", key) == [6]


def _session_alive(pid: int) -> bool:
    import sqlalchemy as sa

    admin = sa.create_engine(POSTGRES_ADMIN_URL)
    try:
        with admin.connect() as other:
            query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p")
            return bool(other.execute(query, {"p": pid}).scalar())
    finally:
        admin.dispose()


# --------------------------------------------------------------------------- publish on commit


@pytest.fixture
def fulfil(databases: list[str], redis_url: str) -> Iterator[Any]:
    """A task published on commit (issue 34, item 1), its broker a private redis-server
    whose queue the test reads; `fulfil.broker` is that server."""
    from celery import Celery

    from jobfence.tasks import install, singleton_task
    from tests.servers import RedisServer

    with RedisServer() as broker:
        app = Celery(_new("oncommit").replace(":", "-"), set_as_current=False)
        app.conf.update(broker_url=broker.url, task_serializer="json", accept_content=["json"])
        runtime = install(app, Settings(lock_url=redis_url))

        @singleton_task(app=app, key=["order"], name=_new("fulfil").replace(":", "-"))
        def fulfil(order: str) -> str:
            return order

        fulfil.broker = broker
        yield fulfil
        runtime.close()
        app.close()


def _queued(holder: Any) -> list[str]:
    """The task ids on the "celery" queue of `holder.broker` (a task's or an app's)."""
    import json

    client = holder.broker.client()
    try:
        return [json.loads(m)["headers"]["id"] for m in client.lrange("celery", 0, -1)]
    finally:
        client.close()


def _outbox(alias: str, task_id: str) -> list[Any]:
    with connections[alias].cursor() as cur:
        cur.execute("SELECT sent_at FROM jobfence_outbox WHERE task_id = %s", [task_id])
        return [r[0] for r in cur.fetchall()]


def test_apply_async_on_commit_publishes_when_the_atomic_block_commits(
    fulfil: Any, alias: str
) -> None:
    with transaction.atomic(using=alias):
        result = fulfil.apply_async_on_commit(("o1",), using=alias)
        assert _outbox(alias, result.id) == [None], "the row is in the caller's transaction"
        assert _queued(fulfil) == [], "published before the commit"
    assert _queued(fulfil) == [result.id]
    [sent_at] = _outbox(alias, result.id)
    assert sent_at is not None


def test_delay_on_commit_in_a_block_that_rolls_back_leaves_nothing(fulfil: Any) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        result = fulfil.delay_on_commit("o2")
        raise RuntimeError("the request failed")
    assert _queued(fulfil) == [] and _outbox("default", result.id) == []


def test_delay_on_commit_outside_a_block_publishes_at_once(fulfil: Any) -> None:
    result = fulfil.delay_on_commit("o3")  # autocommit: the row commits as it is written
    assert _queued(fulfil) == [result.id]
    assert _outbox("default", result.id) != [None]


# ------------------------------------------------------- a Django task enqueued on commit

CARRIER_APP: Any = None


def bill(invoice: int) -> int:
    return invoice


def _engine_of(alias: str) -> Any:
    """An SQLAlchemy engine on Django's database `alias` (the relay reads the outbox so)."""
    from jobfence.tasks import make_engine

    db = django_settings.DATABASES[alias]
    if db["ENGINE"].endswith("sqlite3"):
        return make_engine(f"sqlite:///{db['NAME']}")
    return make_engine(f"postgresql+psycopg://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}")


@pytest.fixture
def carried(databases: list[str], redis_url: str) -> Iterator[Any]:
    """CeleryBackend's Celery app on a private redis-server broker (stopped by the tests
    that need the broker away), with a jobfence runtime for the outbox relay."""
    pytest.importorskip("jobfence.tasks.django_tasks", reason="needs django.tasks or the backport")
    from celery import Celery

    import jobfence.tasks.django_tasks  # noqa: F401  (registers the carrier on shared apps)
    from jobfence.tasks import install
    from tests.servers import RedisServer

    global CARRIER_APP
    with RedisServer() as broker:
        app = Celery(_new("carried").replace(":", "-"), set_as_current=False)
        app.conf.update(broker_url=broker.url, task_serializer="json", accept_content=["json"],
                        broker_connection_timeout=0.5, task_publish_retry=False,
                        broker_transport_options={"socket_timeout": 0.5,
                                                  "socket_connect_timeout": 0.5})  # fmt: skip
        runtime = install(app, Settings(lock_url=redis_url))
        CARRIER_APP = app
        app.broker = broker
        yield app
        runtime.close()
        app.close()


def _tasks_setting(alias: str | None, *, on_commit: bool = True) -> dict[str, Any]:
    """TASKS with one CeleryBackend, "celery", enqueueing on commit on `alias`."""
    options: dict[str, Any] = {"app": f"{__name__}.CARRIER_APP"}
    if on_commit:
        options.update(enqueue_on_commit=True, using=alias)
    return {"celery": {"BACKEND": "jobfence.tasks.django_tasks.CeleryBackend",
                       "OPTIONS": options}}  # fmt: skip


def _bill_task() -> Any:
    from tests.djtasks import task

    return task(backend="celery")(bill)


def test_a_django_task_enqueued_on_commit_is_sent_when_the_block_commits(
    carried: Any, alias: str
) -> None:
    with override_settings(TASKS=_tasks_setting(alias)):
        billed = _bill_task()
        with transaction.atomic(using=alias):
            result = billed.enqueue(7)
            assert _outbox(alias, result.id) == [None], "the row is in the caller's transaction"
            assert _queued(carried) == [], "sent before the commit"
        assert _queued(carried) == [result.id]
        [sent_at] = _outbox(alias, result.id)
        assert sent_at is not None


def test_a_django_task_enqueued_in_a_block_that_rolls_back_sends_nothing(carried: Any) -> None:
    with (
        override_settings(TASKS=_tasks_setting("pg")),
        pytest.raises(RuntimeError),
        transaction.atomic(using="pg"),
    ):
        result = _bill_task().enqueue(8)
        raise RuntimeError("the request failed")
    assert _queued(carried) == [] and _outbox("pg", result.id) == []


def test_a_django_task_whose_broker_was_down_at_the_commit_is_sent_by_the_relay(
    carried: Any,
) -> None:
    """The broker stopped at the commit: the enqueue's row stays unsent (the caller's commit
    stands), and the relay sends it once the broker is back. The control,
    in the same run: Django's own `transaction.on_commit(partial(task.enqueue, ...))` on a
    plain CeleryBackend loses its job at the same commit, with nothing left to send."""
    from functools import partial

    from jobfence.tasks import runtime_for
    from jobfence.tasks.outbox import SqlOutbox
    from jobfence.worker.outbox_relay import OutboxRelay

    broker = carried.broker
    broker.stop()
    with override_settings(TASKS=_tasks_setting("pg")), transaction.atomic(using="pg"):
        durable = _bill_task().enqueue(9)
    with (
        override_settings(TASKS=_tasks_setting(None, on_commit=False)),
        pytest.raises(Exception, match=r"(?i)connect|refused|timed out"),
        transaction.atomic(using="pg"),
    ):
        transaction.on_commit(partial(_bill_task().enqueue, 10), using="pg")
    assert _outbox("pg", durable.id) == [None], "the durable row is committed and unsent"
    broker.start()
    assert _queued(carried) == [], "the control's job is gone: nothing was sent"
    engine = _engine_of("pg")
    relay = OutboxRelay(carried, runtime_for(carried), SqlOutbox(engine), grace=0.0, poll=0.05,
                        retention=3600.0)  # fmt: skip
    try:
        assert relay.relay_once() == 1
    finally:
        engine.dispose()
    assert _queued(carried) == [durable.id]
    [sent_at] = _outbox("pg", durable.id)
    assert sent_at is not None


def test_celery_backend_options_are_checked_by_name(databases: list[str]) -> None:
    pytest.importorskip("jobfence.tasks.django_tasks", reason="needs django.tasks or the backport")
    from jobfence.tasks import TaskDefinitionError
    from jobfence.tasks.django_tasks import CeleryBackend

    def make(**options: Any) -> Any:
        return CeleryBackend("celery", {"OPTIONS": {"app": "celery.current_app", **options}})

    with pytest.raises(TaskDefinitionError, match=r"'enqueue_on_comit'.*did you mean "
                                                  r"'enqueue_on_commit'"):  # fmt: skip
        make(enqueue_on_comit=True)
    with pytest.raises(TaskDefinitionError, match=r"enqueue_on_commit'\] must be True or False"):
        make(enqueue_on_commit="yes")
    with pytest.raises(TaskDefinitionError, match="only enqueue_on_commit uses"):
        make(using="pg")
    assert make(enqueue_on_commit=True, using="pg").using == "pg"
