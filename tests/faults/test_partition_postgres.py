"""A network partition between a lease holder and PostgreSQL (namespaces + nftables).

Fault: a private PostgreSQL (`tests.servers.PostgresServer`) listens on the host's end of a
veth pair; the holder process runs inside the namespace and takes a lease. nftables then
drops every packet on that link. The lease runs out on the server clock
(``clock_timestamp()``), a client outside takes the key with a higher fence and writes;
then the partition heals and the cut-off holder, which never stopped, writes too.

Control: a naive holder (a lock row with an expiry, no fence) writes after the heal: two
ledger rows for one job, the double effect.

jobfence: the outside grant's fence is above the holder's; the holder's write after the
heal carries the old fence and SqlFenceGuard (same database) refuses it, and its extension
is refused: one ledger row, under the newer fence.

Needs root, `ip` and `nft`: skipped with the reason otherwise (CI runs as root).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from jobfence.locks import Lease
from jobfence.locks.backends.postgres import PostgresBackend
from jobfence.locks.guards import SqlFenceGuard
from tests.faults import netns
from tests.faults.netns import NetNamespace
from tests.servers import PostgresServer, PostgresServerError, ProcessGroup, wait_for

pytestmark = pytest.mark.fault

TTL = 3.0
SLACK = 20.0  # headroom for a loaded box: interpreter start-up inside the namespace, ...
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[NetNamespace, PostgresServer]]:
    """One namespace and one private server for the module (initdb takes seconds)."""
    reason = netns.unavailable() or PostgresServer.unavailable()
    if reason is not None:
        pytest.skip(reason)
    try:
        ns = NetNamespace.create()
    except netns.NetnsError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    with ns:
        try:
            server = PostgresServer(listen=("127.0.0.1", ns.host_address), trust=(str(ns.subnet),))
        except PostgresServerError as exc:
            pytest.skip(f"cannot start a private PostgreSQL here: {exc}")
        with server:
            yield ns, server


@pytest.fixture
def ledger(
    setup: tuple[NetNamespace, PostgresServer], request: pytest.FixtureRequest
) -> Iterator[tuple[str, sa.Engine]]:
    ns, server = setup
    name = f"ledger_{request.node.name[-12:].replace('[', '_').replace(']', '')}"
    engine = sa.create_engine(server.url, pool_pre_ping=True)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        conn.execute(sa.text(f"CREATE TABLE {name} (job text, who text, fence bigint)"))
    try:
        yield name, engine
    finally:
        ns.heal()
        engine.dispose()


class Holder:
    """The holder process in the namespace and its event file."""

    def __init__(
        self, group: ProcessGroup, ns: NetNamespace, server: PostgresServer, tmp: Path,
        *, mode: str, key: str, ledger: str,
    ) -> None:  # fmt: skip
        self.events_path = tmp / f"{mode}-events.jsonl"
        self.go = tmp / f"{mode}-go"
        self.events_path.touch()
        self.group = group
        self.proc: subprocess.Popen[bytes] = group.spawn(
            [
                *ns.exec_prefix, sys.executable, "-m", "tests.faults.pg_partition_holder",
                "--mode", mode, "--url", server.url_for(ns.host_address), "--key", key,
                "--ledger", ledger, "--ttl", str(TTL),
                "--events", str(self.events_path), "--go", str(self.go),
            ],
            cwd=REPO,
            name=f"pg-holder-{mode}",
        )  # fmt: skip

    def events(self) -> list[dict[str, Any]]:
        lines = self.events_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def event(self, *names: str, timeout: float = SLACK) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            found = [e for e in self.events() if e["event"] in names]
            if not found and self.proc.poll() is not None:
                raise AssertionError(f"holder exited without {names}:\n{self.log()}")
            return found[0] if found else None

        found = wait_for(find, timeout, message=lambda: f"no {names} event:\n{self.log()}")
        assert found is not None
        return found

    def log(self) -> str:
        return f"events: {self.events()}\n{self.group.log_of(self.proc)}"


def test_control_naive_holder_writes_after_the_partition_heals(
    setup: tuple[NetNamespace, PostgresServer],
    ledger: tuple[str, sa.Engine],
    process_group: ProcessGroup,
    tmp_path: Path,
) -> None:
    (ns, server), (table, engine) = setup, ledger
    key = "job:naive"
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE IF EXISTS naive_lock"))
        conn.execute(sa.text("CREATE TABLE naive_lock (key text PRIMARY KEY, expires timestamptz)"))
    holder = Holder(process_group, ns, server, tmp_path, mode="naive", key=key, ledger=table)
    holder.event("holding")
    ns.cut()

    def take() -> bool:  # outside: the same naive lock, once its expiry has passed
        with engine.begin() as conn:
            conn.execute(
                sa.text("DELETE FROM naive_lock WHERE key = :k AND expires <= clock_timestamp()"),
                {"k": key},
            )
            got = conn.execute(
                sa.text(
                    "INSERT INTO naive_lock VALUES (:k, clock_timestamp() + interval '3 s') "
                    "ON CONFLICT DO NOTHING RETURNING key"
                ),
                {"k": key},
            ).first()
            return got is not None

    wait_for(take, TTL + SLACK, interval=0.05, message="the naive lock never expired")
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} VALUES (:k, 'outside', NULL)"), {"k": key})
    ns.heal()
    holder.go.touch()
    holder.event("wrote")
    with engine.connect() as conn:
        who = conn.execute(sa.text(f"SELECT who FROM {table} ORDER BY who")).scalars().all()
    assert who == ["namespace", "outside"]  # the job's effect, twice


def test_partitioned_holder_is_fenced_out_after_its_lease_expires_on_the_server(
    setup: tuple[NetNamespace, PostgresServer],
    ledger: tuple[str, sa.Engine],
    process_group: ProcessGroup,
    tmp_path: Path,
) -> None:
    (ns, server), (table, engine) = setup, ledger
    key = "job:fenced"
    guard = SqlFenceGuard()
    guard.create_schema(engine)
    holder = Holder(process_group, ns, server, tmp_path, mode="jobfence", key=key, ledger=table)
    holding = holder.event("holding", "busy")
    assert holding["event"] == "holding", holder.log()
    ns.cut()
    cut_at = time.time()

    backend = PostgresBackend.from_url(server.url, prefix="part", socket_timeout=2.0)
    try:
        first = backend.attempt(key, 10.0)
        if time.time() - holding["at"] < TTL - 0.5:
            assert not isinstance(first, Lease), "granted while the holder's lease was live"
        # The lease runs out on the server clock although its holder never released it.
        got: Lease | None = wait_for(
            lambda: backend.try_acquire(key, 10.0),
            TTL + SLACK,
            interval=0.05,
            message="the partitioned holder's lease never expired on the server",
        )
        assert got is not None and got.fence > holding["fence"]
        assert time.time() - cut_at < TTL + SLACK
        with guard.transaction(engine, f"ledger:{key}", got.fence) as conn:
            conn.execute(
                sa.text(f"INSERT INTO {table} VALUES (:k, 'outside', :f)"),
                {"k": key, "f": got.fence},
            )

        ns.heal()
        holder.go.touch()
        late = holder.event("refused", "wrote")
        assert late["event"] == "refused" and late["fence"] == holding["fence"], holder.log()
        assert holder.event("extend-refused", "extended")["event"] == "extend-refused"
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT who, fence FROM {table}")).all()
        assert [tuple(r) for r in rows] == [("outside", got.fence)]  # once, newer fence
        assert got.release()
    finally:
        backend.close()
