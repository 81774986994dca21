"""The redis harness's worker processes: two real ``celery worker``s the model pauses and kills.

They consume only :data:`QUEUE` (the in-process worker only ``celery``), so a ``pause_worker``
or ``kill_worker`` step knows which processes hold the job it routes there. Every worker keeps
custody of its deliveries (jobfence.worker.custody): while one is stopped or dead the others'
sweeps put its deliveries back, under fresh tags, at the head of QUEUE, where the other
process takes them: a paused holder's job gets a new holder, which a later kill can crash.
They are signalled only by their own pids (tests.integration.celery_fleet.Fleet).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from tests.integration.celery_fleet import Fleet

__all__ = ["BEGIN_TIMEOUT", "QUEUE", "SecondWorker"]

#: The worker processes' own queue.
QUEUE = "model.second"
#: Two processes of one thread each: one holds the routed job, the other takes its copy.
WORKERS = 2
#: How long a step waits for a worker process to begin the job it routed there.
BEGIN_TIMEOUT = 10.0


class SecondWorker:
    """``celery -A tests.model.worker_main worker -Q model.second`` x2 (threads pool, one each)."""

    def __init__(self, env: Mapping[str, str], base_dir: Path) -> None:
        self.fleet = Fleet(
            "tests.model.worker_main", workers=WORKERS, concurrency=1, pool="threads",
            env=env, base_dir=base_dir, loglevel="WARNING", extra_args=("-Q", QUEUE),
        )  # fmt: skip
        self.killed_at = 0.0  # monotonic instant the last restart's kills were done

    def ensure(self) -> None:
        """Start them on the first step that needs them (a module with none pays nothing)."""
        if not all(self.fleet.alive(i) for i in range(WORKERS)):
            self.fleet.start()

    def stop(self) -> None:
        self.fleet.stop(timeout=10.0)

    def holder(self, task_id: str) -> int | None:
        """The index of the worker process that began ``task_id`` last, if one did."""
        began = [e.worker for e in self.fleet.events(task_id) if e.kind == "prerun"]
        return began[-1] if began else None

    def pause(self, index: int) -> None:
        self.fleet.pause(self.fleet.main_pid(index))

    def resume(self, index: int) -> None:
        self.fleet.resume(self.fleet.main_pid(index))

    def restart(self, env: Mapping[str, str] | None = None) -> set[str]:
        """SIGKILL every worker process (whatever they hold) and start them again (with
        ``env`` added to theirs from now on, if given). Returns the task ids whose last
        delivery here had not had its decisions stored: they may be lost with the kill."""
        for index in range(WORKERS):
            if self.fleet.alive(index):
                self.fleet.kill_worker(index, with_children=True)
        self.killed_at = time.monotonic()  # every process dead: no body is inside after this
        events = self.fleet.events()  # read after the kill: nothing is written to it since
        # A task's last delivery here whose decisions its process never reported stored:
        # running at the kill (an effect committed, the delivery not ended), or ended with
        # its decisions still in the process's writer (every FLUSH_INTERVAL, later on a
        # starved machine). The kill loses them; a stored batch is on the lock server.
        last: dict[str, tuple[int, int]] = {}  # task id -> (its last prerun's line, pid)
        stored: dict[tuple[str, int], int] = {}  # (task id, pid) -> its last stored line
        for line, e in enumerate(events):
            if e.kind == "prerun":
                last[e.task_id] = (line, e.pid)
            elif e.kind == "stored":
                stored[e.task_id, e.pid] = line
        ended = {task_id for task_id, (line, pid) in last.items()
                 if stored.get((task_id, pid), -1) < line}  # fmt: skip
        if env is not None:
            self.fleet.env.update(env)
        self.fleet.start()
        return ended
