"""`python -m jobfence outbox`: what the publish-on-commit outbox holds (unsent, failing)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from jobfence.config.settings import ENV_PREFIX


def add_outbox_parser(sub: Any) -> None:
    """The `outbox` command."""
    outbox = sub.add_parser(
        "outbox",
        help="what the publish-on-commit outbox holds: unsent rows, the oldest, failing ones",
        description="Count jobfence_outbox's rows: committed and not yet sent (the relay sends "
        "them after JOBFENCE_OUTBOX_GRACE), the age of the oldest, those whose publish "
        "failed, and the sent rows kept until JOBFENCE_OUTBOX_RETENTION. Exit status 1 when "
        "a row has waited longer than --stale seconds: a relay is not running, or the broker "
        "refuses.",
    )
    outbox.add_argument(
        "--database",
        metavar="URL",
        help="SQLAlchemy URL of the outbox's database (default: JOBFENCE_OUTBOX_URL, else "
        "JOBFENCE_DATABASE_URL)",
    )
    outbox.add_argument(
        "--stale",
        metavar="SECONDS",
        type=float,
        default=60.0,
        help="an unsent row older than this is reported stale, exit status 1 (default 60)",
    )


def cmd_outbox(args: argparse.Namespace) -> int:
    import sqlalchemy as sa

    from jobfence.tasks.effects import make_engine, outbox

    raw = (args.database or os.environ.get(f"{ENV_PREFIX}OUTBOX_URL")
           or os.environ.get(f"{ENV_PREFIX}DATABASE_URL"))  # fmt: skip
    if not raw:
        print(f"jobfence outbox: no database: set {ENV_PREFIX}OUTBOX_URL or pass --database URL",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        engine = make_engine(raw)
        where = sa.make_url(raw).render_as_string(hide_password=True)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ValueError) as exc:
        print(f"jobfence outbox: bad database URL ({type(exc).__name__})", file=sys.stderr)
        return 2
    try:
        counted = _count(engine)
    except sa.exc.DBAPIError as exc:
        print(f"jobfence outbox: {where}: {type(exc.orig).__name__}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    if counted is None:
        print(f"jobfence outbox: no {outbox.name} table on {where}: run `python -m jobfence "
              "migrate`", file=sys.stderr)  # fmt: skip
        return 2
    waiting, oldest, failing, sent = counted
    age = 0.0 if oldest is None else max(0.0, time.time() - float(oldest))
    print(f"outbox on {where}")
    print(f"  unsent:  {waiting}" + (f" (the oldest {age:.1f}s old)" if waiting else ""))
    print(f"  failing: {failing} (a publish of theirs failed; the relay tries again)")
    print(f"  sent:    {sent} (kept until pruned)")
    if waiting and age > args.stale:
        print(f"stale: a committed message has waited {age:.0f}s: is a worker with "
              f"{ENV_PREFIX}OUTBOX_URL running, and does the broker accept?")  # fmt: skip
        return 1
    return 0


def _count(engine: Any) -> tuple[int, float | None, int, int] | None:
    """(unsent rows, the oldest one's creation time, unsent rows that failed, sent rows);
    None without the table."""
    import sqlalchemy as sa

    from jobfence.tasks.effects import outbox as t

    unsent = t.c.sent_at.is_(None)
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(t.name):
            return None
        waiting, oldest, failing = conn.execute(
            sa.select(sa.func.count(), sa.func.min(t.c.created_at),
                      sa.func.count().filter(t.c.attempts > 0)).where(unsent)
        ).one()  # fmt: skip
        sent = conn.execute(sa.select(sa.func.count()).where(~unsent)).scalar_one()
    return int(waiting), oldest, int(failing), int(sent)
