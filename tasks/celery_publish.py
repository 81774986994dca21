"""Publishing a singleton task once: the publish claim, given back when the publish fails,
and a delivered message published again as itself (no claim made for it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore, Reject

from jobfence.locks.drive import run_sync
from jobfence.tasks.celery_spec import burst_key
from jobfence.tasks.publish import give_back_flow, publish_flow

if TYPE_CHECKING:
    from jobfence.tasks.celery_task import SingletonTask

#: The publish option the outbox sends a committed message with (tasks/outbox.py).
OUTBOX_OPTION = "jobfence_outbox"
#: Publish options that make a workflow wait on the published task id (chain, group, chord).
WORKFLOW_OPTIONS = ("chain", "link", "link_error", "chord", "group_id")
#: The Celery shell's logger, named as before the shell was split in files.
log = logging.getLogger("jobfence.tasks.celery_task")


def publish_once(
    task: SingletonTask, key: str, task_id: str, options: dict[str, Any],
    publish: Callable[[], Any], *, committed: float | None = None,
    earlier: tuple[str, ...] = (),
) -> Any:  # fmt: skip
    """Claim the key for `task_id` and publish; a duplicate gets `on_duplicate_publish`
    (tasks/publish.py decides). A workflow's duplicate, and a `committed` one (sent from
    the outbox: its caller is gone; the time its row was written), goes out unclaimed and
    meets the running copy at the gate (docs/explanation/delivery-policy.md), as does a
    committed one that meets a newer publish's claim. `earlier`: the job's keys under
    earlier secrets (a rotation), where a publish that replaces started runs claims too."""
    rt = task._runtime()
    backend = rt.backend
    ttl = _dedupe_ttl(task, rt.settings.visibility_timeout, options)
    workflow = committed is not None or any(options.get(name) for name in WORKFLOW_OPTIONS)
    policy = task.jobfence_options.on_duplicate_publish
    if committed is not None and policy == "raise":
        policy = "result"  # no caller to raise to: unclaimed, as a workflow's duplicate
    flow = publish_flow(key, task_id, ttl, policy=policy, workflow=workflow, name=task.name,
                        replace_started=task.jobfence_options.replaces_started,
                        written_at=committed)  # fmt: skip
    decision = run_sync(flow, backend, backend.clock)
    also: list[tuple[str, str | None]] = []
    if decision.action == "claimed" and task.jobfence_options.replaces_started:
        also = _claim_under_earlier_secrets(task, earlier, task_id, ttl, workflow, committed)
    if decision.action == "result":
        return task.AsyncResult(decision.holder)
    if decision.action == "unclaimed":
        log.info("%s: a copy is queued or running as task %s; this publish carries a "
                 "workflow, so it goes out and meets that copy at the gate",
                 task.name, decision.holder)  # fmt: skip
        return publish()
    try:
        out = publish()
    except BaseException:
        # Nothing of ours was queued: the claim goes back, so the next publish goes out.
        for each, previous in [(key, decision.previous), *also]:
            flow_back = give_back_flow(each, task_id, ttl, previous=previous)
            if not run_sync(flow_back, backend, backend.clock):
                log.error("%s: replacing task %s failed and its claim could not be given "
                          "back", task.name, previous)  # fmt: skip
        raise
    if decision.previous is not None:
        log.info("%s: task %s replaced queued task %s", task.name, task_id,
                 decision.previous)  # fmt: skip
    return out


def _claim_under_earlier_secrets(
    task: SingletonTask, earlier: tuple[str, ...], task_id: str, ttl: float, workflow: bool,
    written_at: float | None,
) -> list[tuple[str, str | None]]:  # fmt: skip
    """A rotation, where a publish replaces started runs (supersede, debounce): the claim
    under each earlier secret's key names this publish too, so a delivery under either
    secret reads the newest publish alike. The model's long run: a run under secret B had
    marked B's key started; the next publish, under A, replaced only A's, and its delivery
    under B met the older run's mark and was superseded by it (the newest never ran).
    Returns (key, the value replaced there) for each, to give back if the publish fails."""
    backend = task._runtime().backend
    made: list[tuple[str, str | None]] = []
    for key in earlier:
        flow = publish_flow(key, task_id, ttl, policy="replace", workflow=workflow,
                            name=task.name, replace_started=True,
                            written_at=written_at)  # fmt: skip
        decision = run_sync(flow, backend, backend.clock)
        if decision.action == "claimed":
            made.append((key, decision.previous))
    return made


def debounce_countdown(task: SingletonTask, key: str) -> float:
    """`debounce`: this publish runs after the quiet period, unless the burst's first publish
    was so long ago that `debounce_max_wait` comes first. The first publish's time is kept
    on the lock server (a claim of its own, freed when the debounced run starts), so every
    publisher of the fleet measures from it (wall clocks: keep them in step, as NTP does)."""
    o = task.jobfence_options
    assert o.debounce is not None
    if o.debounce_max_wait is None:
        return o.debounce
    backend = task._runtime().backend
    now = time.time()
    held = backend.claim_publish(burst_key(key), repr(now), o.debounce_max_wait + o.debounce)
    first = now if held is None else float(held)
    return max(0.0, min(o.debounce, first + o.debounce_max_wait - now))


def _dedupe_ttl(task: SingletonTask, visibility_timeout: float, options: dict[str, Any]) -> float:
    base = task.jobfence_options.dedupe_ttl or visibility_timeout
    return base + float(options.get("countdown") or 0)


def publish_again(task: SingletonTask, req: Any, countdown: float,
                  headers: dict[str, Any]) -> NoReturn:  # fmt: skip
    """Publish the delivered message `req` again (same id; `headers` from `Marks.onto`, so
    no publish claim is made for it), then ack this delivery. If the publish fails, the
    message goes back to the broker instead (Reject with requeue): never dropped."""
    try:
        task.signature_from_request(req, countdown=countdown, headers=headers).apply_async()
    except Exception as exc:
        log.warning("re-publish of %s[%s] failed (%s): requeued", task.name, req.id, exc)
        raise Reject(exc, requeue=True) from exc
    raise Ignore()
