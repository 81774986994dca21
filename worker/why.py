"""`jobfence locks why KEY_OR_TASK_ID`: why did this job (not) run, from the decision log."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from jobfence.locks.decisions import Decision, DecisionLog
from jobfence.tasks.decisions import describe
from jobfence.worker.admin import printable


def find(store: DecisionLog, query: str, n: int = 50) -> tuple[str, list[Decision]]:
    """("task", the task's decisions) if `query` is a task id the log knows, else ("key", the
    key's decisions); each list oldest first, the holders' decisions on the key kept aside."""
    mine = [d for d in store.for_task(query, store.bounds.total) if d.task_id == query]
    if mine:
        return "task", mine[-n:]
    return "key", store.for_key(query, n)


def holder_fence(store: DecisionLog, d: Decision, cache: dict[str, list[Decision]]) -> int | None:
    """The fence the holder `d` names had on the key, where the log shows it."""
    if not d.holder:
        return None
    if d.key not in cache:
        cache[d.key] = store.for_key(d.key, store.bounds.per_key)
    fences = [e.fence for e in cache[d.key] if e.task_id == d.holder and e.fence is not None]
    return fences[-1] if fences else None


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1000):03d}Z"


def render(store: DecisionLog, query: str, n: int = 50) -> tuple[list[str], list[dict[str, Any]]]:
    """(lines for a terminal, the same as JSON-ready data); both empty if nothing is known."""
    what, found = find(store, query, n)
    if not found:
        return [], []
    cache: dict[str, list[Decision]] = {}
    first = found[0]
    head = (f"task {query} ({first.task_name}), key {first.key}:" if what == "task"
            else f"key {query}:")  # fmt: skip
    lines, data = [head], []
    for d in found:
        words = describe(d, holder_fence(store, d, cache))
        fence = "-" if d.fence is None else str(d.fence)
        lines.append(f"  {_when(d.at)}  {d.event:<10}  task {d.task_id or '-'}  fence {fence}  "
                     f"{words}")  # fmt: skip
        data.append({**asdict(d), "explained": words})
    return [printable(line) for line in lines], data
