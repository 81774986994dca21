"""ZooKeeper faults: a leader killed under contention, a holder cut off, a server's data lost.

1. A 3-node ensemble loses its leader (kill -9) while a lease is held and others wait for
   it: hold intervals never overlap, fences rise in grant order, and the lease held across
   the election either rides through it or is marked lost before anyone else gets the key.
2. A holder inside a network namespace is cut off (nftables drop, both ways). Control: a
   holder on kazoo's own Lock recipe (no fence) writes after the heal, beside the new
   holder: two ledger rows for one job. jobfence: the server expires the holder's session,
   the new holder's fence is higher, the cut-off holder marked its lease lost before that
   grant, and its fenced write after the heal is refused: one row, the newer fence.
3. A single server restarted from its data directory: fences keep rising. Restarted with an
   empty one: zxids start again, but the fence base is taken anew from the server clock, so
   every fence is still above every earlier one; the old leases are lost, not resumed.

The namespace tests need root, `ip` and `nft` (skipped with the reason otherwise).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kazoo.client import KazooClient

from devstack import local_zookeeper
from devstack.local_zookeeper import ZooKeeperEnsemble, ZooKeeperServer
from jobfence.locks import (
    AcquireTimeout,
    BackendUnavailable,
    Lease,
    LeaseKeeper,
    Locker,
    SqlFenceGuard,
)
from jobfence.locks.backends.zookeeper import ZooKeeperBackend
from tests.faults import netns
from tests.faults.netns import NetNamespace
from tests.servers import ProcessGroup, wait_for

pytestmark = pytest.mark.fault

TTL = 2.0
SLACK = 20.0  # headroom for a loaded box: interpreter start-up inside the namespace, ...
REPO = Path(__file__).resolve().parents[2]


def _skip_without_zookeeper() -> None:
    reason = local_zookeeper.unavailable()
    if reason is not None:
        pytest.skip(reason)


def _chroot() -> str:
    return f"/f{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------- leader killed


@pytest.fixture(scope="module")
def ensemble() -> Iterator[ZooKeeperEnsemble]:
    _skip_without_zookeeper()
    with ZooKeeperEnsemble() as ens:
        yield ens


@dataclass
class Hold:
    worker: int
    fence: int
    granted: float  # monotonic, this process
    ended: float  # released, or marked lost, whichever came first
    lost: bool
    released: bool
    extended: bool  # an extension was confirmed (the deadline moved past grant + TTL)


def _hold(worker: int, locker: Locker, lease: Lease, granted: float, seconds: float) -> Hold:
    """Hold `lease` (granted at `granted`) for `seconds` (less if lost), release it, say
    what happened."""
    first_deadline = lease.deadline
    lost_at: list[float] = []
    lease.on_lost(lambda _l, _c: lost_at.append(time.monotonic()))
    while time.monotonic() < granted + seconds and not lease.lost:
        time.sleep(0.005)
    end = time.monotonic()
    extended = lease.deadline > first_deadline
    try:
        released = locker.release(lease)
    except BackendUnavailable:
        released = False
    lost = bool(lost_at) or lease.lost
    return Hold(worker, lease.fence, granted, min([end, *lost_at]), lost, released, extended)


class Contender(threading.Thread):
    """Takes the key again and again (its own client and keeper), holds it, releases it."""

    def __init__(self, n: int, url: str, key: str, stop: threading.Event) -> None:
        super().__init__(name=f"contender-{n}", daemon=True)
        self.n, self.key, self.stop_ = n, key, stop
        backend = ZooKeeperBackend.from_url(url, prefix="kill", socket_timeout=1.0)
        self.locker = Locker(backend, keeper=LeaseKeeper(), ttl=TTL, timeout=1.0)
        self.holds: list[Hold] = []

    def run(self) -> None:
        try:
            while not self.stop_.is_set():
                try:
                    lease = self.locker.acquire(self.key)
                except (AcquireTimeout, BackendUnavailable):  # busy, or during the election
                    time.sleep(0.05)
                    continue
                self.holds.append(_hold(self.n, self.locker, lease, time.monotonic(), 0.3))
        finally:
            self.locker.close()


def test_leader_killed_while_leases_are_held_and_contended(ensemble: ZooKeeperEnsemble) -> None:
    url = ensemble.url + _chroot()
    key = "job:leader"
    stop = threading.Event()
    contenders = [Contender(n, url, key, stop) for n in range(3)]
    backend = ZooKeeperBackend.from_url(url, prefix="kill", socket_timeout=1.0)
    mine = Locker(backend, keeper=LeaseKeeper(), ttl=TTL, timeout=SLACK)
    leader: ZooKeeperServer | None = None
    for c in contenders:
        c.start()
    try:
        wait_for(lambda: sum(len(c.holds) for c in contenders) >= 3, SLACK,
                 message="the contenders never took turns")  # fmt: skip
        lease = mine.acquire(key)  # one more contender, whose turn spans the election
        granted = time.monotonic()
        leader = ensemble.leader()
        killed_at = time.monotonic()
        leader.kill()  # kill -9: its clients' connections drop, the others elect a leader
        # Held past its TTL: only extensions through the new leader keep it.
        held = _hold(99, mine, lease, granted, 1.5 * TTL)
        assert ensemble.leader() is not leader
        wait_for(lambda: any(h.granted > held.ended for c in contenders for h in c.holds),
                 SLACK, message="no grant after the election")  # fmt: skip
    finally:
        stop.set()
        for c in contenders:
            c.join(SLACK)
        mine.close()
        if leader is not None:
            leader.start()  # back, as a follower

    holds = sorted([held, *(h for c in contenders for h in c.holds)], key=lambda h: h.granted)
    for before, after in itertools.pairwise(holds):
        assert after.granted >= before.ended, f"two holders at once: {before} and {after}"
        assert after.fence > before.fence, f"fence did not rise: {before} and {after}"
    assert held.granted < killed_at < held.ended
    # It rode through the election (extended, released as its own), or it was given up
    # before the key went to anyone else (the loop above checks the "before").
    assert (held.extended and held.released and not held.lost) or held.lost, held
    assert len({h.worker for h in holds}) >= 3  # mine and at least two contenders


# --------------------------------------------------------------------------- partition


@pytest.fixture(scope="module")
def partition_setup() -> Iterator[tuple[NetNamespace, ZooKeeperServer]]:
    """One namespace and one private server listening on the host's end of its link."""
    _skip_without_zookeeper()
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    try:
        ns = NetNamespace.create()
    except netns.NetnsError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    with ns, ZooKeeperServer(listen=ns.host_address) as server:
        yield ns, server


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[tuple[str, sa.Engine]]:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE ledger (job text, who text, fence bigint)"))
    yield url, engine
    engine.dispose()


class Holder:
    """The holder process in the namespace and its event file."""

    def __init__(
        self, group: ProcessGroup, ns: NetNamespace, url: str, ledger: str, tmp: Path,
        *, mode: str, key: str,
    ) -> None:  # fmt: skip
        self.events_path = tmp / f"{mode}-events.jsonl"
        self.go = tmp / f"{mode}-go"
        self.events_path.touch()
        self.group = group
        self.proc: subprocess.Popen[bytes] = group.spawn(
            [
                *ns.exec_prefix, sys.executable, "-m", "tests.faults.zk_partition_holder",
                "--mode", mode, "--url", url, "--key", key, "--ledger", ledger,
                "--ttl", str(TTL), "--events", str(self.events_path), "--go", str(self.go),
            ],
            cwd=REPO,
            name=f"zk-holder-{mode}",
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


def _rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT who, fence FROM ledger ORDER BY who"))
        return [tuple(r) for r in rows]


def test_control_kazoo_lock_holder_writes_after_the_partition_heals(
    partition_setup: tuple[NetNamespace, ZooKeeperServer],
    ledger: tuple[str, sa.Engine],
    process_group: ProcessGroup,
    tmp_path: Path,
) -> None:
    (ns, server), (ledger_url, engine) = partition_setup, ledger
    url = server.url + _chroot()
    holder = Holder(process_group, ns, url, ledger_url, tmp_path, mode="naive", key="job")
    holder.event("holding")
    chroot = url.split(server.address, 1)[1]
    outside = KazooClient(server.address, timeout=TTL)
    outside.start(timeout=10)
    try:
        with ns.partitioned():
            # kazoo's Lock is granted once the holder's session expires on the server.
            assert outside.Lock(f"{chroot}/naive/job").acquire(timeout=TTL + SLACK)
            with engine.begin() as conn:
                conn.execute(sa.text("INSERT INTO ledger VALUES ('job', 'outside', NULL)"))
        holder.go.touch()
        holder.event("wrote")
    finally:
        outside.stop()
        outside.close()
    assert _rows(engine) == [("namespace", None), ("outside", None)]  # the effect, twice


def test_partitioned_holder_is_fenced_out_and_knew_it_first(
    partition_setup: tuple[NetNamespace, ZooKeeperServer],
    ledger: tuple[str, sa.Engine],
    process_group: ProcessGroup,
    tmp_path: Path,
) -> None:
    (ns, server), (ledger_url, engine) = partition_setup, ledger
    url = server.url + _chroot()
    guard = SqlFenceGuard()
    guard.create_schema(engine)
    holder = Holder(process_group, ns, url, ledger_url, tmp_path, mode="jobfence", key="job")
    holding = holder.event("holding", "busy")
    assert holding["event"] == "holding", holder.log()
    assert holding["ttl"] == TTL

    backend = ZooKeeperBackend.from_url(url, prefix="part", socket_timeout=1.0)
    try:
        ns.cut()
        got = wait_for(lambda: backend.try_acquire("job", 10.0), TTL + SLACK, interval=0.02,
                       message="the holder's session never expired on the server")  # fmt: skip
        granted_at = time.time()
        assert got.fence > holding["fence"]
        with guard.transaction(engine, "ledger:job", got.fence) as conn:
            conn.execute(sa.text("INSERT INTO ledger VALUES ('job', 'outside', :f)"),
                         {"f": got.fence})  # fmt: skip
        # Cut off, the holder still declared its lease lost before the server let it go.
        lost = holder.event("lost", timeout=1.0)
        assert lost["at"] < granted_at, (lost, granted_at)

        ns.heal()
        holder.go.touch()
        late = holder.event("refused", "wrote")
        assert late["event"] == "refused" and late["fence"] == holding["fence"], holder.log()
        assert holder.event("extend-refused", "extended")["event"] == "extend-refused"
        assert _rows(engine) == [("outside", got.fence)]  # once, under the newer fence
        assert got.release()
    finally:
        ns.heal()
        backend.close()


# --------------------------------------------------------------------------- lost data


@pytest.fixture(scope="module")
def single() -> Iterator[ZooKeeperServer]:
    _skip_without_zookeeper()
    with ZooKeeperServer() as server:
        yield server


def _grants(backend: ZooKeeperBackend, key: str, n: int) -> list[int]:
    fences = []
    for _ in range(n):
        lease = wait_for(lambda: _try(backend, key), SLACK, interval=0.05,
                         message="no grant")  # fmt: skip
        fences.append(lease.fence)
        assert lease.release()
    return fences


def _try(backend: ZooKeeperBackend, key: str) -> Lease | None:
    try:
        return backend.try_acquire(key, TTL)
    except BackendUnavailable:  # reconnecting
        return None


def test_server_restarted_from_its_data_keeps_fences_rising(single: ZooKeeperServer) -> None:
    url = single.url + _chroot()
    old = ZooKeeperBackend.from_url(url, prefix="restart", socket_timeout=1.0)
    try:
        before = _grants(old, "job", 20)
        base = old._base_us
        single.kill()  # kill -9, then the same data directory
        single.start()
        after = _grants(old, "job", 20)  # the same client, once reconnected
        fresh = ZooKeeperBackend.from_url(url, prefix="restart")
        try:
            after += _grants(fresh, "job", 20)
            assert fresh._base_us == base, "the fence base moved although the data stayed"
        finally:
            fresh.close()
        fences = before + after
        assert all(a < b for a, b in itertools.pairwise(fences)), fences
    finally:
        old.close()


def test_server_restarted_empty_rebases_fences_above_the_old_ones(single: ZooKeeperServer) -> None:
    url = single.url + _chroot()
    old = ZooKeeperBackend.from_url(url, prefix="wiped", socket_timeout=1.0)
    try:
        before = _grants(old, "job", 20)
        held = old.try_acquire("held", TTL)
        assert held is not None
        single.restart(fresh=True)  # a new, empty data directory: zxids start again at 1
        # A process that never saw the old fences: the new base alone puts it above them.
        newcomer = ZooKeeperBackend.from_url(url, prefix="wiped")
        try:
            first = _grants(newcomer, "job", 1)[0]
            assert first > max(before)
            assert newcomer._base_us is not None and newcomer._base_us > (old._base_us or 0)
        finally:
            newcomer.close()
        # The old client: the server refuses its session (it has seen a later zxid); once
        # the session could have expired it starts a new one, on the new base.
        after = _grants(old, "job", 20)
        assert min(after) > max([*before, first])
        assert held.lost and held.release() is False
    finally:
        old.close()
