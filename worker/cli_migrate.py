"""`python -m jobfence migrate`: create jobfence's SQL tables (fences, records, outbox) and a SQL
lock backend's tables now, or print their DDL."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jobfence.worker.cli_common import AppNotFound, add_app_option, project_settings, say_source


def add_migrate_parser(sub: Any) -> None:
    """The `migrate` command."""
    migrate = sub.add_parser(
        "migrate",
        help="create jobfence's SQL tables (fences, job records, outbox, SQL locks) now",
        description="Create jobfence's tables (jobfence_fences, jobfence_jobs, jobfence_outbox) "
        "where they are "
        "missing, and the lock backend's tables when the lock URL is PostgreSQL or "
        "MySQL/MariaDB; safe to repeat. Workers create them on first use anyway: run this "
        "when a DBA or a deploy step owns the schema and the workers' role may not create "
        "tables.",
    )
    add_app_option(migrate)
    migrate.add_argument(
        "--database", metavar="URL", help="SQLAlchemy URL (default: JOBFENCE_DATABASE_URL)"
    )
    migrate.add_argument(
        "--lock-url",
        metavar="URL",
        help="lock server (default: JOBFENCE_LOCK_URL); its tables are made for "
        "postgresql:// and mysql:// / mariadb:// URLs, nothing for Redis",
    )
    migrate.add_argument(
        "--sql",
        action="store_true",
        help="print the DDL for the URL's dialect instead of running it (connects to nothing)",
    )


def cmd_migrate(args: argparse.Namespace) -> int:
    from jobfence.config.settings import ENV_PREFIX

    raw = args.database or os.environ.get(f"{ENV_PREFIX}DATABASE_URL")
    lock_url = args.lock_url or os.environ.get(f"{ENV_PREFIX}LOCK_URL")
    if args.app:  # the project's own settings, as its workers read them
        try:
            settings = project_settings(args, args.lock_url)
        except AppNotFound as exc:
            print(f"jobfence migrate: {exc}", file=sys.stderr)
            return 2
        raw, lock_url = args.database or settings.database_url, settings.lock_url
        say_source(args, settings, args.lock_url)
    sql_locks = lock_url is not None and _lock_scheme(lock_url) is not None
    if not raw and not sql_locks:
        print(
            f"jobfence migrate: no database: set {ENV_PREFIX}DATABASE_URL or pass --database "
            "URL (e.g. postgresql+psycopg://user@db.internal/app), or a PostgreSQL or "
            f"MySQL lock URL ({ENV_PREFIX}LOCK_URL or --lock-url)",
            file=sys.stderr,
        )
        return 2
    if raw:
        status = _migrate_effects(raw, sql=args.sql)
        if status:
            return status
    if sql_locks:
        assert lock_url is not None
        return _migrate_locks(lock_url, sql=args.sql)
    return 0


def _lock_scheme(url: str) -> str | None:
    """'postgres' or 'mysql' for a SQL lock URL, else None (Redis, memory: no tables)."""
    from jobfence.locks import registry

    try:
        name = registry.entry_for(url).name
    except ValueError:
        return None
    return name if name in ("postgres", "mysql") else None


def _migrate_effects(raw: str, *, sql: bool) -> int:
    """The SQL effects' tables (jobfence_fences, jobfence_jobs, jobfence_outbox) on `raw`."""
    import sqlalchemy as sa

    from jobfence.locks.sql import SchemaError, create_tables, ddl
    from jobfence.tasks.effects import TABLES, make_engine

    try:
        url = sa.make_url(raw)
        if sql:
            for statement in ddl(url.get_dialect()(), TABLES):
                print(f"{statement};\n")
            return 0
        engine = make_engine(raw)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ValueError) as exc:
        print(f"jobfence migrate: bad database URL ({exc})", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        print(
            f"jobfence migrate: the driver {exc.name} is missing: "
            "pip install 'jobfence[postgres]' (or [mysql])",
            file=sys.stderr,
        )
        return 2
    where = url.render_as_string(hide_password=True)
    try:
        created = create_tables(engine, TABLES)
    except SchemaError as exc:
        print(f"jobfence migrate: {exc}", file=sys.stderr)
        return 1
    except sa.exc.DBAPIError as exc:
        print(f"jobfence migrate: {where}: {type(exc.orig).__name__}: {exc.orig}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    for table in TABLES:
        print(f"{table.name}: {'created' if table.name in created else 'already there'}")
    print(f"jobfence tables ready on {where}")
    return 0


def _migrate_locks(lock_url: str, *, sql: bool) -> int:
    """The lock backend's tables on a PostgreSQL or MySQL/MariaDB lock URL."""
    import sqlalchemy as sa

    from jobfence.config.settings import ENV_PREFIX
    from jobfence.locks import LockError, open_backend

    kind = _lock_scheme(lock_url)
    prefix = os.environ.get(f"{ENV_PREFIX}KEY_PREFIX") or "jobfence"
    try:
        backend: Any = open_backend(lock_url, prefix=prefix)
    except (LockError, ValueError, ImportError) as exc:
        print(f"jobfence migrate: bad lock URL ({exc})", file=sys.stderr)
        return 2
    try:
        if sql:
            for statement in backend.ddl():
                print(f"{statement};\n")
            return 0
        objects = _lock_objects(backend, kind)
        engine = sa.create_engine(_inspection_url(lock_url, kind), poolclass=sa.pool.NullPool)
        where = engine.url.render_as_string(hide_password=True)
        try:
            before, after = _create_lock_tables(backend, engine, objects)
        except (sa.exc.DBAPIError, LockError) as exc:
            print(f"jobfence migrate: lock tables on {where}: {exc}", file=sys.stderr)
            return 1
        finally:
            engine.dispose()
    finally:
        backend.close()
    return _report_lock_tables(objects, before, after, where)


def _lock_objects(backend: Any, kind: str | None) -> list[tuple[str, str]]:
    """(kind of object, name) of each table (and PostgreSQL's fence sequence) the lock
    backend makes."""
    if kind == "postgres":
        from jobfence.locks.backends.postgres import FENCE_SEQUENCE, TABLE

        return [("table", TABLE), ("sequence", FENCE_SEQUENCE)]
    tables = [*backend.tables.values(), backend.rate_table]  # rates: made with them
    return [("table", name.strip("`")) for name in tables]


def _inspection_url(lock_url: str, kind: str | None) -> str:
    """The SQLAlchemy URL that asks what exists (the backends talk to their driver directly)."""
    rest = lock_url.split("://", 1)[1]
    return ("postgresql+psycopg://" if kind == "postgres" else "mysql+pymysql://") + rest


def _create_lock_tables(
    backend: Any, engine: Any, objects: list[tuple[str, str]]
) -> tuple[set[str], set[str]]:
    """Create the lock backend's tables; the names of `objects` present before and after."""
    import sqlalchemy as sa

    def present() -> set[str]:
        inspector = sa.inspect(engine)
        return {
            name
            for what, name in objects
            if (inspector.has_sequence(name) if what == "sequence"
                else inspector.has_table(name))
        }  # fmt: skip

    before = present()
    backend.create_tables()
    return before, present()


def _report_lock_tables(
    objects: list[tuple[str, str]], before: set[str], after: set[str], where: str
) -> int:
    """Each object's state (already there, created, missing); 1 if any is missing."""
    for what, name in objects:
        state = "already there" if name in before else "created" if name in after else "missing"
        print(f"{name}: {state}" + (" (sequence)" if what == "sequence" else ""))
    if any(name not in after for _, name in objects):
        print(f"jobfence migrate: lock tables missing on {where} after creating them",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"jobfence lock tables ready on {where}")
    return 0
