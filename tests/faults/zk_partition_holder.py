"""The holder process of the ZooKeeper partition tests: runs inside a network namespace.

Modes: ``jobfence`` takes the lease (ZooKeeperBackend, kept by a LeaseKeeper), reports it and
the moment it is marked lost, waits for the go file, then tries its fenced ledger write
(SqlFenceGuard on a SQLite file) and an extension; ``naive`` takes kazoo's own Lock recipe
(no fence), waits, then writes unguarded. Events are JSON lines in ``--events``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from kazoo.client import KazooClient

from jobfence.locks import LeaseKeeper, NotOwner, StaleFence
from jobfence.locks.backends.zookeeper import ZooKeeperBackend, parse_url
from jobfence.locks.guards import SqlFenceGuard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["jobfence", "naive"], required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--ledger", required=True, help="SQLAlchemy URL of the ledger")
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--go", required=True)
    args = parser.parse_args()
    out = Path(args.events)

    def emit(event: str, **fields: Any) -> None:
        with out.open("a") as f:
            f.write(json.dumps({"event": event, "at": time.time(), **fields}) + "\n")

    engine = sa.create_engine(args.ledger)
    insert = sa.text("INSERT INTO ledger (job, who, fence) VALUES (:job, 'namespace', :fence)")
    if args.mode == "naive":
        hosts, chroot = parse_url(args.url)
        client = KazooClient(hosts, timeout=args.ttl)
        client.start(timeout=10)
        client.Lock(f"{chroot}/naive/{args.key}").acquire(timeout=10)
        emit("holding")
        wait_go(Path(args.go))
        with engine.begin() as conn:  # a lock recipe without a fence: nothing to check
            conn.execute(insert, {"job": args.key, "fence": None})
        emit("wrote")
        return

    backend = ZooKeeperBackend.from_url(args.url, prefix="part", socket_timeout=1.0)
    keeper = LeaseKeeper()
    lease = backend.try_acquire(args.key, args.ttl)
    if lease is None:
        emit("busy")
        return
    lease.on_lost(lambda _lease, cause: emit("lost", cause=type(cause).__name__))
    keeper.keep(lease)
    emit("holding", fence=lease.fence, ttl=lease.ttl)
    wait_go(Path(args.go))
    try:
        with SqlFenceGuard().transaction(engine, f"ledger:{args.key}", lease.fence) as conn:
            conn.execute(insert, {"job": args.key, "fence": lease.fence})
        emit("wrote", fence=lease.fence)
    except StaleFence as exc:
        emit("refused", fence=lease.fence, error=type(exc).__name__)
    try:
        backend.extend(lease)
        emit("extended")
    except NotOwner:
        emit("extend-refused")
    keeper.stop()
    backend.close()


def wait_go(go: Path) -> None:
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("no go file")
        time.sleep(0.02)


if __name__ == "__main__":
    main()
