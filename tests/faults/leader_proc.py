"""A singleton process for the hand-over tests: it campaigns, and while it leads it writes a
log entry every WRITE_INTERVAL through a fence guard (`fenced`) or blindly (`naive`).

    python -m tests.faults.leader_proc fenced|naive LOCK_URL STORE_URL PREFIX NAME TTL OUT

(the tests fork it with these arguments: `main(argv)`, no interpreter start per process).

Every step is a JSON line in OUT with the process's CLOCK_MONOTONIC time (`mono`, shared by
every process of the host): campaign, elected (fence), write (seq, lost, outcome), on_lost,
resigned. SIGTERM makes a fenced leader leave its block (it resigns) and exit 0; a fenced
leader that learns its term is lost makes one more write, to show the guard refuse it, and
exits 3. The store is Redis (a list, RedisFenceGuard) or SQL (a table, SqlFenceGuard).

SIGUSR1 makes a fenced leader SIGSTOP itself after its current write ("freezing"): a leader
frozen inside its SQL transaction would hold the fence row's lock, and its successor's
guarded write would wait for it (safe, but the refusal could not be shown).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

import redis
import sqlalchemy as sa

from jobfence.locks import Locker, RedisFenceGuard, SqlFenceGuard, StaleFence, Term, open_backend

WRITE_INTERVAL = 0.05
LOST_EXIT = 3


class Out:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def emit(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": event, "mono": time.monotonic(), **fields}) + "\n")


def log_key(prefix: str) -> str:
    return f"{prefix}:log"


def log_table(prefix: str) -> sa.Table:
    return sa.Table(
        f"{prefix}_log",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("writer", sa.Integer, nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
    )


def read_log(store_url: str, prefix: str) -> list[tuple[int, int, int]]:
    """The store's entries in the order they landed: (writer pid, fence, seq)."""
    if store_url.startswith("redis"):
        client = redis.Redis.from_url(store_url)
        try:
            raw = client.lrange(log_key(prefix), 0, -1)
        finally:
            client.close()
        return [tuple(int(x) for x in r.decode().split(":")) for r in raw]  # type: ignore[misc]
    engine = sa.create_engine(store_url)
    table = log_table(prefix)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(table.c.writer, table.c.fence, table.c.seq)
                                .order_by(table.c.id)).all()  # fmt: skip
    finally:
        engine.dispose()
    return [(int(w), int(f), int(s)) for w, f, s in rows]


class FencedStore:
    """Appends (pid, fence, seq) to the log through the resource's fence guard."""

    def __init__(self, store_url: str, prefix: str) -> None:
        self.resource = f"{prefix}:report"
        self.prefix = prefix
        self.pid = os.getpid()
        if store_url.startswith("redis"):
            self.guard: RedisFenceGuard | None = RedisFenceGuard(
                redis.Redis.from_url(store_url), prefix=prefix
            )
        else:
            self.guard = None
            self.engine = sa.create_engine(store_url)
            self.sql = SqlFenceGuard()
            self.table = log_table(prefix)

    def write(self, fence: int, seq: int) -> str:
        try:
            if self.guard is not None:
                entry = f"{self.pid}:{fence}:{seq}"
                self.guard.write(self.resource, fence, [("RPUSH", log_key(self.prefix), entry)],
                                 write_id=str(seq))  # fmt: skip
            else:
                with self.sql.transaction(self.engine, self.resource, fence) as conn:
                    conn.execute(self.table.insert().values(writer=self.pid, fence=fence, seq=seq))
        except StaleFence:
            return "stale"
        return "ok"


def run_fenced(lock_url: str, store_url: str, prefix: str, name: str, ttl: float, out: Out) -> int:
    store = FencedStore(store_url, prefix)
    locker = Locker(open_backend(lock_url, prefix=prefix, socket_timeout=0.5), ttl=ttl)
    stopping, freeze = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGUSR1, lambda *_: freeze.set())
    out.emit("campaign")
    lost, told = False, threading.Event()

    def on_lost(term: Term) -> None:
        out.emit("on_lost", fence=term.fence)
        told.set()

    with locker.leader(name, on_lost=on_lost) as term:
        out.emit("elected", fence=term.fence)
        seq = 0
        while not stopping.is_set():
            lost = term.lost.is_set()
            outcome = store.write(term.fence, seq)
            out.emit("write", seq=seq, lost=lost, outcome=outcome, fence=term.fence)
            if lost:
                break
            if freeze.is_set():  # between writes: see the module's docstring
                out.emit("freezing")
                os.kill(os.getpid(), signal.SIGSTOP)
            seq += 1
            term.lost.wait(WRITE_INTERVAL)
    if lost:
        told.wait(5)  # on_lost runs on a thread of its own: let it finish before exiting
    out.emit("resigned")
    locker.close()
    return LOST_EXIT if lost else 0


def run_naive(lock_url: str, prefix: str, name: str, ttl: float, out: Out) -> int:
    """The lock of the blog posts: SET NX PX, a blind PEXPIRE to renew, no fence."""
    client = redis.Redis.from_url(lock_url)
    key, token, ttl_ms = f"{prefix}:naive:{name}", uuid.uuid4().hex, int(ttl * 1000)
    out.emit("campaign")
    while not client.set(key, token, nx=True, px=ttl_ms):
        time.sleep(WRITE_INTERVAL)
    out.emit("elected", fence=0)
    seq = 0
    while True:
        client.pexpire(key, ttl_ms)
        client.rpush(log_key(prefix), f"{os.getpid()}:0:{seq}")
        out.emit("write", seq=seq, lost=False, outcome="ok", fence=0)
        seq += 1
        time.sleep(WRITE_INTERVAL)


def main(argv: list[str]) -> int:
    mode, lock_url, store_url, prefix, name, ttl, path = argv
    out = Out(path)
    if mode == "naive":
        return run_naive(lock_url, prefix, name, float(ttl), out)
    return run_fenced(lock_url, store_url, prefix, name, float(ttl), out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
