"""Fleets of real ``celery worker`` processes for integration tests: start, kill, freeze, stop."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis

from devstack import procs
from tests.integration.fleet_hooks import INDEX_ENV, STATE_DIR_ENV, safe_name
from tests.servers import ProcessGroup, wait_for

__all__ = [
    "HOOKS_MODULE",
    "POOLS",
    "REPO_ROOT",
    "Fleet",
    "FleetError",
    "FleetFactory",
    "TaskEvent",
    "WorkerProcess",
    "broker_backlog",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Worker pools a ``Fleet`` can run (``--pool``); only prefork has pool child processes.
POOLS = ("prefork", "threads", "solo")
HOOKS_MODULE = "tests.integration.fleet_hooks"
#: How long a fleet must look idle, poll after poll, before `wait_idle` believes it.
IDLE_SETTLE = 0.3


class FleetError(RuntimeError):
    """A worker did not start, or a request targeted a process the fleet does not own."""


@dataclass(frozen=True)
class TaskEvent:
    """One ``prerun`` / ``postrun`` seen by the fleet hooks in a pool process."""

    kind: str
    task_id: str
    task: str | None
    pid: int
    worker: int
    t: float


@dataclass
class WorkerProcess:
    """One started ``celery worker`` main process (``generation`` counts restarts of a slot)."""

    index: int
    generation: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exited(self) -> bool:
        """True once the main process has exited (checked without reaping it)."""
        return procs.exited(self.proc)

    def exit_status(self) -> int | None:
        """The main process's exit code (``-n``: killed by signal n); ``None`` while it runs.

        Read without reaping it, like :attr:`exited`.
        """
        return procs.exit_status(self.proc)


def broker_backlog(broker: redis.Redis, queues: Sequence[str] = ("celery",)) -> dict[str, int]:
    """Messages still waiting in ``queues`` (all priority levels) and delivered but unacked.

    Reads kombu's Redis layout: a list per queue and priority (``<queue>``, or
    ``<queue>\\x06\\x16<n>`` for priority n > 0) and the ``unacked`` hash.
    """
    counts: dict[str, int] = {}
    pipe = broker.pipeline(transaction=False)
    names = [q if p == 0 else f"{q}\x06\x16{p}" for q in queues for p in range(10)]
    for name in names:
        pipe.llen(name)
    pipe.hlen("unacked")
    *lengths, unacked = pipe.execute()
    for name, length in zip(names, lengths, strict=True):
        if length:
            counts[name] = int(length)
    if unacked:
        counts["unacked"] = int(unacked)
    return counts


class Fleet:
    """N real ``celery -A <app_module> worker`` processes (``pool``: prefork by default).

    Workers are ``w0@%h`` .. ``w{N-1}@%h``, started with ``--without-gossip --without-mingle
    --without-heartbeat -O fair --prefetch-multiplier 1``; each leads its own process group
    (its pool children are in it), and only processes in those groups are ever signalled.
    The app is configured only through ``env`` (added to ``os.environ`` for the
    subprocesses; see ``tests/integration/apps/common.py``). :mod:`tests.integration.fleet_hooks`
    is loaded into every worker with ``--include``: it reports readiness and which pool
    process executes which task through files, so nothing here depends on the broker.

    Killed and stopped main processes are left unreaped (zombies) until :meth:`stop`, so
    their pid, and with it their process-group id, cannot be reused by a stranger meanwhile.

    Worth knowing when writing fault tests (prefork pool, Celery 5.7 / billiard 4.3):

    * After :meth:`kill_child` the main process notices the loss either at once or only at
      its next ``maintain_pool`` tick (every 5 s): the dead child's sentinel pipe is not
      always readable, apparently because a younger sibling inherited its write end. Only
      then does ``task_reject_on_worker_lost`` requeue the message, so with a short
      visibility timeout the broker's sweep may redeliver it first (or as well).
    * Celery's pool children set ``PR_SET_PDEATHSIG`` to SIGKILL (``process_initializer``
      in ``celery/concurrency/prefork.py``), so :meth:`kill_worker` kills the pool too, busy
      or not, even without ``with_children``: a task never outlives its main process.
    """

    def __init__(
        self,
        app_module: str,
        *,
        workers: int = 2,
        concurrency: int = 2,
        pool: str = "prefork",
        env: Mapping[str, str] | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        ready_timeout: float = 30.0,
        loglevel: str = "INFO",
        extra_args: Sequence[str] = (),
        cwd: str | os.PathLike[str] = REPO_ROOT,
    ) -> None:
        if workers < 1 or concurrency < 1:
            raise ValueError("a fleet needs at least one worker with concurrency >= 1")
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        self.app_module = app_module
        self.pool = pool
        self.size = workers
        self.concurrency = concurrency
        self.ready_timeout = ready_timeout
        self.loglevel = loglevel
        self.extra_args = tuple(extra_args)
        self.cwd = Path(cwd)
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="jobfence-fleet-"))
        self.state_dir = self.base_dir / "state"
        self.log_dir = self.base_dir / "logs"
        for sub in ("ready", "running"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        pythonpath = os.pathsep.join(
            p for p in (str(self.cwd), os.environ.get("PYTHONPATH", "")) if p
        )
        self.env: dict[str, str] = {
            **(env or {}),
            STATE_DIR_ENV: str(self.state_dir),
            "PYTHONPATH": pythonpath,
            "PYTHONUNBUFFERED": "1",
        }
        self._group = ProcessGroup(self.log_dir)
        self._slots: list[WorkerProcess | None] = [None] * workers
        self._all: list[WorkerProcess] = []  # every main process ever started, for ownership
        self._paused: set[int] = set()

    # -- starting -------------------------------------------------------------------

    def command(self, index: int) -> list[str]:
        """The argv of worker ``index``."""
        return [
            sys.executable, "-m", "celery", "-A", self.app_module, "worker",
            f"--pool={self.pool}", f"--concurrency={self.concurrency}",
            "-n", f"w{index}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-O", "fair", "--prefetch-multiplier=1",
            f"--loglevel={self.loglevel}",
            f"--include={HOOKS_MODULE}",
            *self.extra_args,
        ]  # fmt: skip

    def _spawn(self, index: int) -> WorkerProcess:
        previous = self._slots[index]
        if previous is not None and not previous.exited:
            raise FleetError(f"worker {index} (pid {previous.pid}) is still running")
        generation = previous.generation + 1 if previous is not None else 0
        name = f"w{index}.{generation}"
        proc = self._group.spawn(
            self.command(index),
            env={**self.env, INDEX_ENV: str(index)},
            cwd=self.cwd,
            name=name,
        )
        worker = WorkerProcess(index, generation, proc, self.log_dir / f"{name}.log")
        self._slots[index] = worker
        self._all.append(worker)
        return worker

    def _wait_ready(self, workers: Sequence[WorkerProcess], timeout: float) -> None:
        def all_ready() -> bool:
            for w in workers:
                if w.exited:
                    raise FleetError(
                        f"worker {w.index} (pid {w.pid}) exited during start-up\n"
                        f"--- {w.log_path} ---\n{procs.tail(w.log_path, 60)}"
                    )
            return all((self.state_dir / "ready" / str(w.pid)).exists() for w in workers)

        wait_for(
            all_ready,
            timeout,
            interval=0.05,
            message=lambda: "workers not ready:\n" + self.logs(lines=30),
        )

    def start(self) -> Self:
        """Start every worker that is not running, in parallel; wait until all are ready."""
        for sub in ("ready", "running"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        started = [self._spawn(i) for i, w in enumerate(self._slots) if w is None or w.exited]
        self._wait_ready(started, self.ready_timeout)
        return self

    def start_worker(self, index: int) -> WorkerProcess:
        """(Re)start worker ``index`` (its previous process must have exited); wait for it."""
        worker = self._spawn(index)
        self._wait_ready([worker], self.ready_timeout)
        return worker

    def ensure_running(self) -> list[int]:
        """Resume everything paused and restart dead workers; returns the restarted indexes."""
        for pid in sorted(self._paused):
            with contextlib.suppress(FleetError):
                self.resume(pid)
        self._paused.clear()
        dead = [i for i, w in enumerate(self._slots) if w is None or w.exited]
        if dead:
            self._wait_ready([self._spawn(i) for i in dead], self.ready_timeout)
        return dead

    # -- looking at processes -------------------------------------------------------

    def worker(self, index: int) -> WorkerProcess:
        worker = self._slots[index]
        if worker is None:
            raise FleetError(f"worker {index} was never started")
        return worker

    def main_pid(self, index: int) -> int:
        return self.worker(index).pid

    def main_pids(self) -> list[int]:
        return [w.pid for w in self._slots if w is not None and not w.exited]

    def alive(self, index: int) -> bool:
        worker = self._slots[index]
        return worker is not None and not worker.exited

    def child_pids(self, index: int) -> list[int]:
        """The live pool processes of worker ``index``."""
        main = self.main_pid(index)
        try:
            raw = Path(f"/proc/{main}/task/{main}/children").read_text()
            pids = [int(p) for p in raw.split()]
        except FileNotFoundError:
            pids = []
        return [p for p in pids if procs.pid_alive(p) and self.owns(p)]

    def owns(self, pid: int) -> bool:
        """True if ``pid`` is alive and in the process group of a worker this fleet started."""
        if not procs.pid_alive(pid):
            return False
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            return False
        return any(w.pid == pgid for w in self._all)

    def worker_of(self, pid: int) -> int | None:
        """The index of the worker whose process group ``pid`` belongs to."""
        if not self.owns(pid):
            return None
        pgid = os.getpgid(pid)
        return next(w.index for w in self._all if w.pid == pgid)

    def executing_pids(self, task_id: str | None = None) -> list[int]:
        """Live pool processes currently executing ``task_id`` (any task if ``None``)."""
        pids: set[int] = set()
        with contextlib.suppress(FileNotFoundError):
            for entry in (self.state_dir / "running").iterdir():
                name, _, pid = entry.name.rpartition("@")
                if task_id is not None and name != safe_name(task_id):
                    continue
                if pid.isdigit() and self.owns(int(pid)):
                    pids.add(int(pid))
        return sorted(pids)

    def wait_executing(self, task_id: str, count: int = 1, timeout: float = 10.0) -> list[int]:
        """Wait until at least ``count`` pool processes execute ``task_id``; returns their pids."""
        return wait_for(
            lambda: pids if len(pids := self.executing_pids(task_id)) >= count else [],
            timeout,
            interval=0.02,
            message=lambda: (
                f"task {task_id} not executed by {count} process(es)\n" + self.logs(lines=20)
            ),
        )

    def events(self, task_id: str | None = None) -> list[TaskEvent]:
        """Every prerun/postrun recorded so far (optionally for one task id), in file order."""
        path = self.state_dir / "events.jsonl"
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return []
        events = []
        for line in lines:
            with contextlib.suppress(ValueError, TypeError):
                events.append(TaskEvent(**json.loads(line)))
        return [e for e in events if task_id is None or e.task_id == task_id]

    def log_tail(self, index: int, lines: int = 60) -> str:
        worker = self.worker(index)
        return f"--- {worker.log_path} ---\n{procs.tail(worker.log_path, lines)}"

    def logs(self, lines: int = 40) -> str:
        """The tails of every current worker's log, for assertion messages."""
        return "\n".join(self.log_tail(i, lines) for i, w in enumerate(self._slots) if w)

    def wait_idle(
        self,
        broker: redis.Redis,
        timeout: float = 20.0,
        queues: Sequence[str] = ("celery",),
    ) -> None:
        """Wait until no message is queued or unacked and no pool process executes a task,
        seen so on polls spanning IDLE_SETTLE seconds.

        (A message a worker holds for a future ETA is unacked, so it counts as busy. A message
        kombu has popped from its queue but not yet recorded as unacked is in neither, and no
        pool process runs it yet: one idle look passed it by, and a storm test counted one
        delivery short.)
        """
        idle_since: list[float] = []

        def settled() -> bool:
            if broker_backlog(broker, queues) or self.executing_pids():
                idle_since.clear()
                return False
            now = time.monotonic()
            if not idle_since:
                idle_since.append(now)
            return now - idle_since[0] >= IDLE_SETTLE

        wait_for(
            settled,
            timeout,
            interval=0.05,
            message=lambda: (
                f"fleet not idle: backlog={broker_backlog(broker, queues)} "
                f"executing={self.executing_pids()}"
            ),
        )

    # -- faults ---------------------------------------------------------------------

    def _require_owned(self, pid: int) -> None:
        if not self.owns(pid):
            raise FleetError(f"pid {pid} is not a live process of this fleet")

    def kill_worker(
        self, index: int, *, with_children: bool = False, timeout: float = 10.0
    ) -> None:
        """SIGKILL worker ``index``'s main process (and its group with ``with_children``).

        The pool children die with it anyway (the kernel sends them SIGKILL through
        ``PR_SET_PDEATHSIG``); ``with_children`` only removes the race. Returns once the main
        process has exited.
        """
        worker = self.worker(index)
        if worker.exited:
            raise FleetError(f"worker {index} (pid {worker.pid}) is not running")
        # The leader is not reaped until stop(), so its pgid cannot have been reused.
        procs.signal_process(worker.proc, signal.SIGKILL, group=with_children)
        self._paused.discard(worker.pid)
        if not procs.wait_exited(worker.proc, timeout):
            raise FleetError(f"worker {index} (pid {worker.pid}) survived SIGKILL")
        if with_children:
            pids = [p for p in self._paused if not self.owns(p)]
            self._paused.difference_update(pids)

    def kill_child(self, pid: int, timeout: float = 10.0) -> None:
        """SIGKILL one pool process of this fleet; returns once it is dead (or a zombie)."""
        if any(w.pid == pid for w in self._all):
            raise FleetError(f"pid {pid} is a main process: use kill_worker()")
        self._require_owned(pid)
        os.kill(pid, signal.SIGKILL)
        self._paused.discard(pid)
        wait_for(lambda: not procs.pid_alive(pid), timeout, message=f"pid {pid} survived SIGKILL")

    def pause(self, pid: int, timeout: float = 5.0) -> None:
        """SIGSTOP a process of this fleet (main or pool child); returns once it is stopped."""
        self._require_owned(pid)
        os.kill(pid, signal.SIGSTOP)
        self._paused.add(pid)
        wait_for(
            lambda: procs.proc_state(pid) in ("T", "t", None),
            timeout,
            message=f"pid {pid} did not stop",
        )

    def resume(self, pid: int, timeout: float = 5.0) -> None:
        """SIGCONT a process paused with :meth:`pause`."""
        self._require_owned(pid)
        os.kill(pid, signal.SIGCONT)
        self._paused.discard(pid)
        wait_for(
            lambda: procs.proc_state(pid) not in ("T", "t"),
            timeout,
            message=f"pid {pid} did not continue",
        )

    @contextlib.contextmanager
    def paused(self, pid: int) -> Iterator[None]:
        """Context manager: ``pid`` is frozen inside the block and resumed on exit."""
        self.pause(pid)
        try:
            yield
        finally:
            if self.owns(pid):
                self.resume(pid)

    # -- stopping -------------------------------------------------------------------

    def begin_warm_shutdown(self, index: int) -> WorkerProcess:
        """Send worker ``index``'s main process SIGTERM (warm shutdown) and return at once.

        Its running tasks finish first; watch :meth:`shutting_down` and ``exited``.
        """
        worker = self.worker(index)
        if worker.exited:
            raise FleetError(f"worker {index} (pid {worker.pid}) is not running")
        procs.signal_group(worker.proc, signal.SIGCONT)  # a stopped process can't shut down
        procs.signal_leader(worker.proc, signal.SIGTERM)
        return worker

    def shutting_down(self, index: int) -> bool:
        """True once worker ``index``'s main process has handled a shutdown signal."""
        return (self.state_dir / "shutting-down" / str(self.main_pid(index))).exists()

    def stop_worker(self, index: int, timeout: float = 10.0) -> bool:
        """Warm shutdown of worker ``index`` (SIGTERM), SIGKILL of its group after ``timeout``.

        Returns True if it exited within ``timeout`` on its own.
        """
        worker = self.worker(index)
        procs.signal_group(worker.proc, signal.SIGCONT)  # a stopped process can't shut down
        procs.signal_leader(worker.proc, signal.SIGTERM)
        clean = procs.wait_exited(worker.proc, timeout)
        procs.signal_group(worker.proc, signal.SIGKILL)  # leader unreaped: pgid is still ours
        return clean

    def stop(self, timeout: float = 10.0) -> None:
        """Warm-stop every worker at once (SIGTERM to the main processes), SIGKILL whatever is
        left after ``timeout``, and reap every process this fleet ever started."""
        live = [w for w in self._slots if w is not None and not w.exited]
        for w in live:
            procs.signal_group(w.proc, signal.SIGCONT)
            procs.signal_leader(w.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for w in live:
            procs.wait_exited(w.proc, max(0.0, deadline - time.monotonic()))
        self._group.stop_all(timeout=1.0)  # SIGTERM, then SIGKILL, every group; reaps all
        self._slots = [None] * self.size
        self._all.clear()  # reaped: their pids may belong to strangers from now on
        self._paused.clear()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop(timeout=2.0)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        states = ["up" if self.alive(i) else "down" for i in range(self.size)]
        shape = f"x{self.size}({self.pool} {self.concurrency})"
        return f"<Fleet {self.app_module} {shape} {' '.join(states)}>"

    def describe(self) -> dict[str, Any]:
        """Pids of every live main and pool process, for debugging output."""
        return {
            f"w{i}": {"main": w.pid, "children": self.child_pids(i)}
            for i, w in enumerate(self._slots)
            if w is not None and not w.exited
        }


#: The ``fleet_factory`` fixture: ``make(app_module, *, env, **Fleet kwargs) -> started Fleet``.
FleetFactory = Callable[..., Fleet]
