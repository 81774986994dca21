"""Signal handlers a ``Fleet`` loads into every worker (``--include``) to report state in files.

Nothing here touches the broker, so the files stay readable while Redis is paused or dead.
Layout under ``$FLEET_STATE_DIR``:

``ready/<main pid>``
    Written (atomically) by the worker's main process on ``worker_ready``.
``running/<task id>@<pid>``
    Exists while pool process ``<pid>`` executes a delivery of ``<task id>``
    (``task_prerun`` .. ``task_postrun``; a killed process leaves its file behind).
``events.jsonl``
    One JSON line per ``prerun`` / ``postrun``, appended with ``O_APPEND`` (and, where a
    process reports them, one ``stored`` line per task whose decisions it stored).
``shutting-down/<main pid>``
    Written by the worker's main process when it handles SIGTERM, SIGINT or SIGQUIT
    (``worker_shutting_down``, sent from Celery's signal handler).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celery import signals

STATE_DIR_ENV = "FLEET_STATE_DIR"
INDEX_ENV = "FLEET_WORKER_INDEX"


def _state_dir() -> Path | None:
    raw = os.environ.get(STATE_DIR_ENV)
    return Path(raw) if raw else None


def safe_name(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_.@" else "_" for ch in name) or "_"


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _event(kind: str, task_id: str | None, task: Any) -> None:
    state = _state_dir()
    if state is None or task_id is None:
        return
    record = {
        "kind": kind,
        "task_id": task_id,
        "task": getattr(task, "name", None),
        "pid": os.getpid(),
        "worker": int(os.environ.get(INDEX_ENV, "-1")),
        "t": time.time(),
    }
    _append(state, json.dumps(record) + "\n")
    running = state / "running" / f"{safe_name(task_id)}@{os.getpid()}"
    if kind == "prerun":
        _write_atomic(running, record)
    else:
        running.unlink(missing_ok=True)


def stored_decisions(task_ids: set[str]) -> None:
    """One ``stored`` line per task id whose decisions this process's recorder has just
    stored (the model's worker processes report it: tests/model/worker_main.py)."""
    state = _state_dir()
    if state is None or not task_ids:
        return
    base = {"kind": "stored", "task": None, "pid": os.getpid(),
            "worker": int(os.environ.get(INDEX_ENV, "-1")), "t": time.time()}  # fmt: skip
    _append(state, "".join(json.dumps({**base, "task_id": t}) + "\n" for t in sorted(task_ids)))


def _append(state: Path, lines: str) -> None:
    """Add `lines` to events.jsonl in one O_APPEND write (processes share the file)."""
    fd = os.open(state / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, lines.encode())
    finally:
        os.close(fd)


@signals.worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    state = _state_dir()
    if state is None:
        return
    _write_atomic(
        state / "ready" / str(os.getpid()),
        {
            "pid": os.getpid(),
            "hostname": getattr(sender, "hostname", None),
            "worker": int(os.environ.get(INDEX_ENV, "-1")),
            "t": time.time(),
        },
    )


@signals.worker_shutting_down.connect
def _on_worker_shutting_down(sig: Any = None, how: Any = None, **_: Any) -> None:
    state = _state_dir()
    if state is None:
        return
    _write_atomic(
        state / "shutting-down" / str(os.getpid()),
        {"pid": os.getpid(), "sig": str(sig), "how": str(how), "t": time.time()},
    )


@signals.task_prerun.connect
def _on_task_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    _event("prerun", task_id, task)


@signals.task_postrun.connect
def _on_task_postrun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    _event("postrun", task_id, task)
