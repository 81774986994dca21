"""The holder process of the etcd freeze tests: takes a lock, reports it, writes when told.

Modes: ``jobfence`` takes a kept lease (EtcdBackend + LeaseKeeper), reports its fence, waits
for the go file, then writes its ledger row through SqlFenceGuard and says whether its lease
is still held; ``naive`` takes a plain etcd lock (a lease, kept alive by a thread, and a
create-if-absent txn: no fence), waits, then writes unguarded. Events are JSON lines.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from jobfence.locks import LeaseKeeper, StaleFence
from jobfence.locks.backends.etcd import EtcdBackend
from jobfence.locks.backends.etcd.gateway import Gateway, b64
from jobfence.locks.guards import SqlFenceGuard

INSERT = "INSERT INTO ledger (job, who, fence) VALUES (:job, :who, :fence)"


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
    row = {"job": args.key, "who": "frozen"}
    if args.mode == "naive":
        naive_lock(args.url, args.key, int(args.ttl))
        emit("holding")
        wait_go(Path(args.go))
        with engine.begin() as conn:
            conn.execute(sa.text(INSERT), {**row, "fence": None})
        emit("wrote")
        return

    backend = EtcdBackend.from_url(args.url, prefix="freeze", socket_timeout=1.0)
    keeper = LeaseKeeper()
    lease = backend.try_acquire(args.key, args.ttl)
    if lease is None:
        emit("busy")
        return
    keeper.keep(lease)
    emit("holding", fence=lease.fence)
    wait_go(Path(args.go))
    try:
        with SqlFenceGuard().transaction(engine, f"ledger:{args.key}", lease.fence) as conn:
            conn.execute(sa.text(INSERT), {**row, "fence": lease.fence})
        emit("wrote", fence=lease.fence, lost=lease.lost)
    except StaleFence as exc:
        emit("refused", fence=lease.fence, lost=lease.lost, error=type(exc).__name__)
    keeper.stop()
    backend.close()


def naive_lock(url: str, key: str, ttl: int) -> None:
    """What a plain etcd lock does: a lease kept alive by a thread, the key created on it if
    absent. Nothing downstream checks a token."""
    gateway = Gateway([url.split("://", 1)[1].split(",")[0]], timeout=1.0)
    lease = gateway.call("/v3/lease/grant", {"TTL": ttl})["ID"]
    name = b64(f"naive/{key}")
    reply = gateway.call("/v3/kv/txn", {
        "compare": [{"key": name, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
        "success": [{"request_put": {"key": name, "value": b64("mine"), "lease": lease}}],
    })  # fmt: skip
    if not reply.get("succeeded"):
        raise SystemExit("naive lock was taken")

    def keep_alive() -> None:
        while True:
            time.sleep(ttl / 3)
            try:
                gateway.call("/v3/lease/keepalive", {"ID": lease})
            except Exception:  # a naive keeper just tries again
                continue

    threading.Thread(target=keep_alive, daemon=True).start()


def wait_go(go: Path) -> None:
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("no go file")
        time.sleep(0.01)


if __name__ == "__main__":
    main()
