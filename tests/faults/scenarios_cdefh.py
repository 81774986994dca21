"""Fault rows c, d, e, f, h of issue 8: each run against a naive task and against jobfence.

Each ``row_*`` function runs one side (``"naive"`` or ``"jobfence"``) in ``workdir`` on its
own servers and real ``celery worker`` fleets (see :mod:`tests.faults.rig`) and returns an
:class:`~devstack.faults_report.Outcome`. ``full=False`` is the suite's size,
``full=True`` the fault report's. The tests in ``tests/faults/test_rows_*.py`` assert on
these outcomes; ``python -m jobfence faults`` prints them in one table.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from devstack.faults_report import Outcome, Scenario, Side
from jobfence.locks.backends.redis import parse_record
from tests.faults import fenced_app, hold, naive_app
from tests.faults.rig import HOLD_DB, LEDGER_DB, Rig, plan_payments, wait_until
from tests.integration.celery_fleet import Fleet, broker_backlog

#: Generous: the box is shared and loaded.
SETTLE_TIMEOUT = 90.0


# -- c: the lock server restarts and loses its data mid-storm -------------------------------


def row_c(side: Side, workdir: Path, full: bool) -> Outcome:
    """A payment storm; the lock server (not the broker) restarts empty when a third is done.

    Every payment is published once; once the server is back, the storm goes on with a
    second copy of every other payment (a client retrying, say), so duplicates of payments
    finished before the restart arrive after it. Naive: a plain Redis lock kept as the
    "charged" marker (lost with the server's data).
    """
    n = 60 if full else 16
    planned = plan_payments("c", n)
    with Rig(side, workdir, body_ms=300.0) as rig:
        fleet = rig.fleet(workers=2, concurrency=2)
        task = rig.charge_task("naive.charge_once")
        rig.publish(task, planned)
        wait_until(
            lambda: rig.done(planned) >= n // 3 and fleet.executing_pids(),
            60.0,
            "a third of the payments charged, bodies running",
        )
        at = rig.done(planned)
        rig.locks.restart()  # SIGKILL and start empty on the same port: all data lost
        rig.publish(task, planned[::2])
        rig.settle(fleet, planned, SETTLE_TIMEOUT)
        return rig.tally(planned, f"restart at {at}/{n} charged")


# -- d: the broker restarts (data kept) and acks are lost ----------------------------------


def row_d(side: Side, workdir: Path, full: bool) -> Outcome:
    """Bodies commit their charges and are held before the ack; the broker is SIGKILLed and
    comes back with its data (AOF, so the delivered-unacked messages survive); then the
    workers are SIGKILLed before acking. The broker delivers those messages again.

    Naive: a plain acks_late task (Celery's "reliable" settings) that charges.
    """
    n = 12 if full else 4
    planned = plan_payments("d", n)
    with Rig(side, workdir, persistent_broker=True, hold_acks=True, body_ms=200.0) as rig:
        flag = rig.client(rig.locks, HOLD_DB)
        hold.raise_flag(flag)
        fleet = rig.fleet(workers=2, concurrency=2)
        rig.publish(rig.charge_task("naive.charge"), planned)
        committed = wait_until(
            lambda: rig.done(planned) >= min(n, 4) and rig.done(planned),
            60.0,
            "four bodies committed and held before their ack",
        )
        rig.broker.kill()
        rig.broker.start()  # same port, AOF replayed: queue and unacked messages kept
        for index in range(fleet.size):
            fleet.kill_worker(index, with_children=True)  # the acks are never sent
        hold.lower_flag(flag)
        fleet.ensure_running()
        rig.settle(fleet, planned, SETTLE_TIMEOUT)
        return rig.tally(planned, f"{committed} committed, unacked, at the restart")


# -- e: a message that kills its worker every time -----------------------------------------

POISON_CAP = 3
#: A naive loop must show this many deliveries (more than jobfence ever allows).
LOOP_PROOF = POISON_CAP + 2
DEAD_LETTER = re.compile(r"dead-letter: task fault\.poison key \S+ recorded FAILED")


def row_e(side: Side, workdir: Path, full: bool) -> Outcome:
    """One poison message (its body ``os._exit``s its pool process) with acks_late and
    reject_on_worker_lost. Naive: delivered again and again. jobfence: capped at
    ``1 + POISON_CAP`` body runs, then a FAILED record and one dead-letter ERROR line."""
    job = "poison-1"
    cap = {"JOBFENCE_MAX_CRASHED_DELIVERIES": str(POISON_CAP)}
    with Rig(side, workdir, env_extra=cap) as rig:
        fleet = rig.fleet(workers=1, concurrency=2)
        ledger = rig.client(rig.broker, LEDGER_DB)
        counter = naive_app.deliveries_key(job) if side == "naive" else (
            fenced_app.deliveries_key(job))

        def deliveries() -> int:
            return int(ledger.get(counter) or 0)

        task = "naive.poison" if side == "naive" else fenced_app.POISON
        rig.send(task, [job])
        window = 90.0  # the loop needs seconds per round; generous for a loaded box
        started = time.monotonic()
        if side == "naive":
            with _suppress_timeout():
                wait_until(lambda: deliveries() >= LOOP_PROOF, window, "the poison loop")
            seen = deliveries()
            looping = not rig.idle(fleet)
            return Outcome(
                jobs=1,
                double=0,  # the poison body has no effect: the loop is the breakage
                lost=0,
                detail=f"{seen} deliveries in {time.monotonic() - started:.0f}s"
                + (", still looping" if looping else ""),
                broken=seen >= LOOP_PROOF,
            )
        with _suppress_timeout():
            wait_until(lambda: _dead_letter(fleet), window, "the dead-letter line")
        rig.settle(fleet, [], 30.0)
        seen = deliveries()
        lines = _dead_letter(fleet)
        failed = _failed_record(rig)
        ok = bool(lines) and failed and seen <= 1 + POISON_CAP and rig.idle(fleet)
        return Outcome(
            jobs=1,
            double=0,
            lost=0,
            detail=f"{seen} deliveries (cap {POISON_CAP}), FAILED record "
            f"{'stored' if failed else 'MISSING'}, {len(lines)} dead-letter line(s)",
            broken=not ok,
        )


def _dead_letter(fleet: Fleet) -> list[str]:
    found = []
    for log in sorted(fleet.log_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if DEAD_LETTER.search(line):
                found.append(line)
    return found


def _failed_record(rig: Rig) -> bool:
    """A FAILED job record for the poison job on the lock server (found by state, not key)."""
    client = rig.client(rig.locks)
    for name in client.scan_iter(match="jobfence:job:*"):
        raw = client.get(name)
        if raw and parse_record(raw.decode()).state == "FAILED":
            return True
    return False


class _suppress_timeout:
    """Leave a ``wait_until`` early without failing: the outcome says what was seen."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return exc_type is TimeoutError


# -- f: prefetched messages when a worker is SIGKILLed --------------------------------------


def row_f(side: Side, workdir: Path, full: bool) -> Outcome:
    """One worker prefetches 4 messages per process (8 held), two bodies run; SIGKILL.

    Both sides run with the same prefetch multiplier. Naive: Celery's default early ack."""
    n = 16 if full else 8
    planned = plan_payments("f", n)
    with Rig(side, workdir, body_ms=1500.0) as rig:
        fleet = rig.fleet(workers=1, concurrency=2, prefetch=4)
        rig.publish(rig.charge_task("naive.charge_locked"), planned)
        broker = rig.client(rig.broker)
        # 2 processes x multiplier 4 = 8 messages held; an early ack frees two more slots.
        # kombu's Redis transport moves a message to `unacked` a step after BRPOP took it
        # off the queue: a SIGKILL between the two loses that message on any broker side,
        # jobfence or not. So strike only once the window is full and no fetch is in
        # flight: the queue down to what the window leaves, `unacked` steady for a while.
        steady: list[int] = []

        def window_full_and_still() -> bool:
            backlog = broker_backlog(broker)
            queued = sum(v for k, v in backlog.items() if k != "unacked")
            unacked = backlog.get("unacked", 0)
            steady.append(unacked)
            full = (
                len(fleet.executing_pids()) >= 2
                and unacked >= min(n - 2, 8)
                and queued <= max(0, n - 8)
            )
            return full and len(steady) >= 10 and len(set(steady[-10:])) == 1

        wait_until(window_full_and_still, 60.0, "the worker's prefetch window full and still")
        held = int(broker.hlen("unacked"))
        fleet.kill_worker(0, with_children=True)
        fleet.start_worker(0)
        rig.settle(fleet, planned, SETTLE_TIMEOUT)
        return rig.tally(planned, f"SIGKILL with {held} messages held")


# -- h: the lock server down at start-up, and again mid-run ---------------------------------


def row_h(side: Side, workdir: Path, full: bool) -> Outcome:
    """Workers start with the lock server down; payments arrive; it starts. Later it dies
    mid-run with bodies running and new payments arriving, and comes back (empty).

    Naive: a plain Redis lock around the charge (SET NX EX, DEL), Celery's defaults."""
    n = 10 if full else 4
    first = plan_payments("h1", n)
    second = plan_payments("h2", 2 * n)  # more than the 4 pool processes: some wait queued
    with Rig(side, workdir, start_locks=False, body_ms=800.0) as rig:
        fleet = rig.fleet(workers=2, concurrency=2)  # must start with no lock server
        task = rig.charge_task("naive.charge_locked")
        rig.publish(task, first)
        wait_until(lambda: _preruns(fleet) >= n, 60.0, "every payment delivered once")
        rig.locks.start()
        wait_until(
            lambda: rig.done(first) >= n or rig.idle(fleet), SETTLE_TIMEOUT, "the first wave"
        )
        rig.publish(task, second)
        wait_until(lambda: fleet.executing_pids(), 60.0, "bodies of the second wave running")
        seen = _preruns(fleet)
        rig.locks.kill()
        wait_until(lambda: _preruns(fleet) >= seen + 2, 60.0, "deliveries with the server down")
        rig.locks.start()
        rig.settle(fleet, first + second, SETTLE_TIMEOUT)
        return rig.tally(first + second, "down at start, then mid-run")


def _preruns(fleet: Fleet) -> int:
    return sum(1 for e in fleet.events() if e.kind == "prerun")


SCENARIOS = [
    Scenario("c", "lock server restarts, all data lost, mid payment storm", row_c),
    Scenario("d", "broker restarts (AOF kept), workers die after commit: acks lost", row_d),
    Scenario("e", "a message that kills its worker every time", row_e),
    Scenario("f", "worker SIGKILLed holding prefetched messages (multiplier 4)", row_f),
    Scenario("h", "lock server down when workers start, and again mid-run", row_h),
]
