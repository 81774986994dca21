"""A Celery delivery read into the flow's JobSpec: the task's template, what the message
carries, its rate limit and its identities under earlier secrets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobfence.locks.errors import RateLimitUnsupported
from jobfence.locks.registry import backends_with
from jobfence.tasks.executor import RATE_HORIZON, JobSpec, RateSpec
from jobfence.tasks.flow.marks import BROKER_REDELIVERED, Marks
from jobfence.tasks.keys import concurrency_key, identity, job_key
from jobfence.tasks.runtime import Runtime

if TYPE_CHECKING:
    from jobfence.tasks.celery_task import SingletonTask


def delivery_spec(task: SingletonTask, rt: Runtime, arguments: dict[str, Any], req: Any) -> JobSpec:
    """This delivery as the flow needs it: the job's identity, its options, what the
    message carries (`Marks`) and what the broker and the workflow around it are."""
    marks = Marks.read(req.headers, request_fields(req))
    key, fp = task._identity(rt, arguments, marks.key)
    o = task.jobfence_options
    queues = not (req.called_directly or req.is_eager)
    return _template(task, rt).but(
        key=key,
        fingerprint=fp,
        task_id=req.id or "",
        redeliveries=marks.redeliveries,
        suspect=marks.deferred or _redelivered(req),
        queues=queues,
        concurrency_key=(
            concurrency_key(rt.secret, task.name, arguments, o.concurrency_key)
            if o.concurrency
            else ""
        ),
        rate=None if o.rate is None else _rate_spec(task, rt, arguments, queues, marks.rate_slot),
        previous=(
            previous_identities(task, rt, arguments, marks.key) if rt.previous_secrets else ()
        ),
        marks=marks,
        in_workflow=bool(req.callbacks or req.chain or req.chord or req.group),
        burst_key=burst_key(key) if o.debounce_max_wait else "",
    )


def burst_key(key: str) -> str:
    """Where a debounced burst of `key` keeps its first publish's time (a publish claim)."""
    return key + ":burst"


def _template(task: SingletonTask, rt: Runtime) -> JobSpec:
    """What every delivery's spec shares: the task's options under the runtime's
    settings, built once per (runtime, options)."""
    s, o = rt.settings, task.jobfence_options
    made = task.__dict__.get("_jobfence_template")
    if made is not None and made[0] is s and made[1] is o:
        return made[2]  # type: ignore[no-any-return]
    template = JobSpec(
        name=task.name,
        key="",
        fingerprint="",
        failed_message=s.failed_record_message,
        max_crashed=s.max_crashed_deliveries,
        claim_ttl=o.dedupe_ttl or s.visibility_timeout,
        supersede=o.dedupe_on_publish and o.on_duplicate_publish == "replace",
        publish_claim=o.dedupe_on_publish,
        replaces_started=o.replaces_started,
        countdown_cap=max(0.1, s.visibility_timeout / 2),
        **o.job_fields(s),
    )
    task.__dict__["_jobfence_template"] = (s, o, template)
    return template


def _rate_spec(
    task: SingletonTask, rt: Runtime, arguments: dict[str, Any], queues: bool, slot: float | None
) -> RateSpec | None:
    """The job's global rate limit, if the task has one: limiter key, policy, turn."""
    o = task.jobfence_options
    rate = o.rate
    if rate is None:
        return None
    if not rt.backend.capabilities.rate_limit:
        raise RateLimitUnsupported(
            f"{task.name} has global_rate_limit={str(rate)!r}, but the "
            f"{rt.backend.name} lock backend keeps no shared rate limits; use "
            f"{backends_with('rate_limit')}"
        )
    if o.rate_key is None:
        limiter = task.name
    else:  # a digest of the chosen arguments, never the arguments themselves
        limiter = job_key(rt.secret, task.name, arguments, selector=o.rate_key)
    policy, wait = o.on_rate_limited, o.wait_timeout
    if policy == "retry" and not queues:
        policy, wait = "wait", RATE_HORIZON  # no broker to come back through: wait here
    return RateSpec(
        key=limiter,
        label=task.name,
        interval=rate.interval,
        burst=rate.burst,
        on_limited=policy,
        wait_timeout=rt.settings.acquire_timeout if wait is None else wait,
        slot=slot,
    )


def previous_identities(
    task: SingletonTask, rt: Runtime, arguments: dict[str, Any], explicit: str | None
) -> tuple[tuple[str, str], ...]:
    """(key, fingerprint) of the job under each earlier secret (JOBFENCE_KEY_SECRET_PREVIOUS)."""
    return tuple(
        identity(old, task.name, arguments, selector=task.jobfence_options.key, explicit=explicit)
        for old in rt.previous_secrets
    )


def request_fields(req: Any) -> dict[str, Any]:
    """The request's own attributes. Celery may put a message's custom headers there; read
    as a dict, a missing one costs no AttributeError (getattr with a default raises one)."""
    fields: dict[str, Any] = getattr(req, "__dict__", {})
    return fields


def _redelivered(req: Any) -> bool:
    """True if the broker redelivered this message (acks_late, reject_on_worker_lost, the
    visibility timeout): it may follow a delivery that died mid-body."""
    info = req.delivery_info or {}
    return bool(info.get("redelivered") or (req.headers or {}).get(BROKER_REDELIVERED))
