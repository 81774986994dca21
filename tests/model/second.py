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

from jobfence.tasks.decisions import FLUSH_INTERVAL
from tests.integration.celery_fleet import Fleet

__all__ = ["BEGIN_TIMEOUT", "QUEUE", "SecondWorker"]

#: The worker processes' own queue.
QUEUE = "model.second"
#: Two processes of one thread each: one holds the routed job, the other takes its copy.
WORKERS = 2
#: How long a step waits for a worker process to begin the job it routed there.
BEGIN_TIMEOUT = 10.0
#: A delivery that ended this recently may have its decisions still in its process's writer
#: (stored every FLUSH_INTERVAL, off the job's path): a SIGKILL then loses them.
UNFLUSHED = 2 * FLUSH_INTERVAL + 0.1


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
        ``env`` added to theirs from now on, if given). Returns the task ids of deliveries
        that ended within UNFLUSHED of the kill: their decisions may be lost with it."""
        since = time.time() - UNFLUSHED
        events = self.fleet.events()
        ended = {e.task_id for e in events if e.kind == "postrun" and e.t >= since}
        # And those running at the kill: an effect committed just before it, its delivery
        # killed before it ended (no postrun), its decisions still in the process's writer.
        done = {e.task_id for e in events if e.kind == "postrun"}
        ended |= {e.task_id for e in events if e.kind == "prerun" and e.task_id not in done}
        for index in range(WORKERS):
            if self.fleet.alive(index):
                self.fleet.kill_worker(index, with_children=True)
        self.killed_at = time.monotonic()  # every process dead: no body is inside after this
        if env is not None:
            self.fleet.env.update(env)
        self.fleet.start()
        return ended
