"""`python -m jobfence locks`: list, inspect and force-release locks, find orphans, and tell
why a job did or did not run (the decision log)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from jobfence.config import Settings
from jobfence.locks import LockBackend
from jobfence.worker.cli_common import (
    AppNotFound,
    add_app_option,
    emit_json,
    positive_int,
    project_settings,
    say_source,
)


def add_locks_parser(sub: Any) -> None:
    """The `locks` command and its actions (list, inspect, release, why, orphans)."""
    locks = sub.add_parser("locks", help="list, inspect, release locks; find orphans")
    add_app_option(locks)
    locks.add_argument(
        "--lock-url",
        "--lock-backend",
        dest="lock_url",
        metavar="URL",
        help="lock server (default: JOBFENCE_LOCK_URL)",
    )
    lsub = locks.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = lsub.add_parser("list", help="held locks")
    ls.add_argument("--match", default="*", metavar="GLOB", help="lock keys matching GLOB")
    ls.add_argument("--json", action="store_true")
    ins = lsub.add_parser("inspect", help="one lock: fence, holder, heartbeat, job record")
    ins.add_argument("key")
    ins.add_argument("--json", action="store_true")
    rel = lsub.add_parser(
        "release",
        help="remove a lock whatever its owner (needs --force)",
        description="Remove a lock whatever its owner, then advance its fence (a grant taken "
        "and released at once), so every later grant is above the removed holder's. The "
        "removed holder's fenced writes fail once a newer fence was accepted for the same "
        "resource; --fence-resource raises a Redis guard's floor now, so they fail at once.",
    )
    rel.add_argument("key")
    rel.add_argument("--force", action="store_true", help="yes, remove it whatever its owner")
    rel.add_argument(
        "--fence-resource",
        action="append",
        default=[],
        metavar="RESOURCE",
        help="a RedisFenceGuard resource (on the lock server) this key's holders write: raise "
        "its floor to the new fence, so the removed holder's writes fail now (repeatable)",
    )
    _add_why_parser(lsub)
    orph = lsub.add_parser(
        "orphans",
        help="locks whose owner is provably dead, and suspects",
        description="A lock is orphaned only if its owner is provably dead: it ran on this "
        "host, in this pid namespace, and its pid is gone or now belongs to a later process "
        "(a stopped process is alive). A heartbeat late for the lock's own TTL, or a holder "
        "elsewhere, is reported as a suspect and never released.",
    )
    orph.add_argument("--match", default="*", metavar="GLOB")
    orph.add_argument(
        "--release", action="store_true", help="release the dead ones (owner-checked)"
    )
    orph.add_argument("--json", action="store_true")

    for action in lsub.choices.values():
        add_app_option(action, inner=True)


def _add_why_parser(lsub: Any) -> None:
    why = lsub.add_parser(
        "why",
        help="why did this job (not) run: its decisions, from the decision log",
        description="The decisions about a task id (or a job key, `<task name>:<hash>` as "
        "`locks list` shows it), in order, in plain words: granted, skipped as a duplicate of "
        "which task, superseded by which publish, a stale write refused, redelivered, given "
        "up. Kept on Redis (JOBFENCE_DECISION_LOG_SIZE per key, for JOBFENCE_DECISION_LOG_TTL); "
        "other backends keep the worker's log lines only (logger jobfence.decisions).",
    )
    why.add_argument("subject", metavar="KEY_OR_TASK_ID")
    why.add_argument("--limit", type=positive_int, default=50, metavar="N",
                     help="the last N decisions (default 50)")  # fmt: skip
    why.add_argument("--json", action="store_true")


def cmd_locks(args: argparse.Namespace) -> int:
    from jobfence.worker import admin

    try:
        settings = project_settings(args, args.lock_url)
    except AppNotFound as exc:
        print(f"jobfence: {exc}", file=sys.stderr)
        return 2
    say_source(args, settings, args.lock_url)
    backend = admin.open_admin_backend(settings)
    try:
        action: Callable[[argparse.Namespace, Settings, LockBackend], int] = {
            "list": _locks_list,
            "inspect": _locks_inspect,
            "release": _locks_release,
            "orphans": _locks_orphans,
            "why": _locks_why,
        }[args.action]
        return action(args, settings, backend)
    finally:
        backend.close()


def _locks_list(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.worker import admin

    infos = sorted(backend.scan(args.match), key=lambda i: i.key)
    now = admin.server_time(backend)
    if args.json:
        emit_json([admin.info_dict(i, now) for i in infos])
    elif infos:
        print(admin.table(infos, now))
    else:
        print(f"no locks held matching {args.match!r}")
    return 0


def _locks_inspect(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.worker import admin

    info = backend.inspect(args.key)
    record = backend.job_record(args.key)
    now = admin.server_time(backend)
    if args.json:
        emit_json({
            "lock": admin.info_dict(info, now) if info else None,
            "record": None if record is None else {
                "state": record.state, "fence": record.fence,
                "finished_at": record.finished_at, "result": record.result,
            },
        })  # fmt: skip
    else:
        print(admin.describe(info, now) if info else admin.printable(f"{args.key}: not held"))
        if record is not None:
            print(admin.printable(
                f"job record:     {record.state} (fence {record.fence}) result {record.result}"
            ))
    return 0 if info is not None else 1


def _locks_release(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.worker import admin

    if not args.force:
        print(
            f"refusing to release {args.key!r} without --force: only its holder can release "
            "it safely. With --force the lock goes whatever its owner and its fence is "
            "advanced; the holder's fenced writes fail once a newer fence was accepted for "
            "the same resource, or at once for each --fence-resource given.",
            file=sys.stderr,
        )
        return 2
    done = admin.force_release(
        backend, args.key, resources=args.fence_resource, guard_prefix=settings.key_prefix
    )
    held = done.held
    key = admin.printable(args.key)
    if held is None:
        print(f"{key}: not held")
    else:
        host = admin.printable(held.host)
        print(f"{key}: released (was fence {held.fence}, host {host}, pid {held.pid})")
    if done.floor is not None:
        print(f"{key}: fence advanced to {done.floor}; every later grant is above it")
    for resource, floor in done.advanced.items():
        print(
            f"{resource}: guard floor now {floor}: writes with an earlier grant's fence "
            f"(below {done.floor}) fail with StaleFence from now on"
        )
    if held is None:
        return 1
    if not done.advanced:
        print(
            f"the removed holder (fence {held.fence}) may still write until a newer fence is "
            "accepted by the resource it writes; to refuse it now, raise the resource's floor "
            f"to {done.floor}: --fence-resource RESOURCE (Redis guard), or "
            "SqlFenceGuard().check_and_advance(conn, RESOURCE, fence) in a transaction (SQL)"
        )
    return 0


def _locks_why(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.locks.decisions import DecisionBounds
    from jobfence.worker import admin, why

    size = settings.decision_log_size
    store = backend.decision_log(DecisionBounds(
        per_key=max(size, 1), total=settings.decision_log_total, ttl=settings.decision_log_ttl,
    )) if size else None  # fmt: skip
    if store is None:
        print(f"the {backend.name} lock backend keeps no decision log"
              + (" (JOBFENCE_DECISION_LOG_SIZE=0)" if not size else "")
              + "; the workers log every decision (logger jobfence.decisions)",
              file=sys.stderr)  # fmt: skip
        return 2
    lines, data = why.render(store, args.subject, args.limit)
    if args.json:
        emit_json(data)
    elif lines:
        print("\n".join(lines))
    else:
        print(admin.printable(
            f"no decisions recorded for {args.subject!r} (kept {size} per key, "
            f"{settings.decision_log_ttl:g}s after the key's last; memory:// keeps them in the "
            "worker's process only)"
        ))
    return 0 if data else 1


def _locks_orphans(args: argparse.Namespace, settings: Settings, backend: LockBackend) -> int:
    from jobfence.worker import admin

    orphans = admin.find_orphans(backend, match=args.match)
    released = []
    if args.release:
        released = [
            o.info.key
            for o in orphans
            if o.dead and admin.release_grant(backend, o.info.key, o.info.fence)
        ]
    now = admin.server_time(backend)
    if args.json:
        emit_json([
            {**admin.info_dict(o.info, now), "reason": o.reason, "dead": o.dead,
             "ttl": None if o.ttl is None else round(o.ttl, 3),
             "released": o.info.key in released}
            for o in orphans
        ])  # fmt: skip
    elif orphans:
        reasons = {o.info.key: ("DEAD: " if o.dead else "suspect: ") + o.reason for o in orphans}
        print(admin.table([o.info for o in orphans], now, reasons))
        for key in released:
            print(f"{admin.printable(key)}: released")
        if any(not o.dead for o in orphans):
            print("suspects are reported only: a late heartbeat or a holder elsewhere is no proof")
    else:
        print("no orphaned or suspect locks")
    return 0
