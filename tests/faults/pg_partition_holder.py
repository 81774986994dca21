"""The holder process of the PostgreSQL partition test: runs inside a network namespace.

Modes: ``jobfence`` takes the lease (fence from the database), reports it, waits for the go
file, then tries its fenced ledger write (SqlFenceGuard, same database) and an extension;
``naive`` takes a plain lock row (no fence), waits, then writes unguarded. Events are JSON
lines in ``--events``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from jobfence.locks import BackendUnavailable, NotOwner, StaleFence
from jobfence.locks.backends.postgres import PostgresBackend
from jobfence.locks.guards import SqlFenceGuard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["jobfence", "naive"], required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--go", required=True)
    args = parser.parse_args()
    out = Path(args.events)

    def emit(event: str, **fields: Any) -> None:
        with out.open("a") as f:
            f.write(json.dumps({"event": event, "at": time.time(), **fields}) + "\n")

    engine = sa.create_engine(args.url, pool_pre_ping=True)
    row = {"job": args.key, "who": "namespace"}
    insert = sa.text(f"INSERT INTO {args.ledger} (job, who, fence) VALUES (:job, :who, :fence)")
    if args.mode == "naive":
        with engine.begin() as conn:  # a lock row with an expiry on the server clock, no fence
            conn.execute(
                sa.text(
                    "INSERT INTO naive_lock VALUES (:k, clock_timestamp() + :ttl * interval '1 s')"
                ),
                {"k": args.key, "ttl": args.ttl},
            )
        emit("holding")
        wait_go(Path(args.go))
        with engine.begin() as conn:
            conn.execute(insert, {**row, "fence": None})
        emit("wrote")
        return

    backend = PostgresBackend.from_url(args.url, prefix="part", socket_timeout=1.0)
    lease = backend.try_acquire(args.key, args.ttl)
    if lease is None:
        emit("busy")
        return
    emit("holding", fence=lease.fence)
    wait_go(Path(args.go))
    try:
        with SqlFenceGuard().transaction(engine, f"ledger:{args.key}", lease.fence) as conn:
            conn.execute(insert, {**row, "fence": lease.fence})
        emit("wrote", fence=lease.fence)
    except StaleFence as exc:
        emit("refused", fence=lease.fence, error=type(exc).__name__)
    for attempt in (0, 1):  # a connection the partition broke may fail the first try
        try:
            backend.extend(lease)
            emit("extended")
        except NotOwner:
            emit("extend-refused")
        except BackendUnavailable:
            if attempt == 0:
                continue
            raise
        break
    backend.close()


def wait_go(go: Path) -> None:
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("no go file")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
