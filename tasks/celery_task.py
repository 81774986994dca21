"""The Celery side: SingletonTask and @singleton_task gate every delivery through the executor."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, overload

from celery import Task, shared_task
from celery._state import _task_stack
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid

from jobfence.locks.drive import run_sync
from jobfence.locks.errors import BackendUnavailable, LockError, RateLimitUnsupported
from jobfence.locks.lease import Lease
from jobfence.locks.ops import SwapPublish
from jobfence.locks.outage import OUTAGE
from jobfence.locks.registry import backends_with
from jobfence.tasks.context import JobContext, current_job, current_lease
from jobfence.tasks.errors import (
    ArgumentsNotSerializable,
    DuplicateSkipped,
    JobDropped,
    JobSkipped,
    JobSuperseded,
    RateLimitSkipped,
    TaskDefinitionError,
    TaskError,
)
from jobfence.tasks.executor import RATE_HORIZON, STARTED, JobSpec, Outcome, RateSpec, Status
from jobfence.tasks.keys import KeySelector, bind_arguments, concurrency_key, identity, job_key
from jobfence.tasks.options import (
    DEFAULTS,
    OPTION_NAMES,
    OPTIONS,
    ConflictPolicy,
    DuplicatePublishPolicy,
    LeaseLostPolicy,
    LockUntil,
    RateLimitedPolicy,
    TaskOptions,
    add_option_attributes,
    attribute_of,
    celery_option_names,
    refuse_unknown,
    split_options,
)
from jobfence.tasks.publish import give_back_flow, publish_flow
from jobfence.tasks.runtime import Runtime, runtime_for

HEADER = "jobfence_idempotency_key"
#: How often the job came back because its fate was unknown (apart from Celery's retries).
REDELIVERIES = "jobfence_redeliveries"
#: Set on the copy a delivery re-publishes when its own earlier delivery holds the lease
#: (it crashed, or still runs): a grant of that copy counts towards the poison cap.
DEFERRED_HEADER = "jobfence_deferred"
#: Set by `_copy_headers` on every copy of a delivered message published again (a requeue, a
#: rate turn, a deferred copy, a redelivery, a retry): apply_async takes it off and makes no
#: publish claim, so the copy is never de-duplicated away against a newer publish.
REPUBLISHED = "jobfence_republished"
#: Set on the copy a rate-limited delivery re-publishes: the server time of the turn it
#: reserved, so the copy starts then without spending another.
RATE_SLOT_HEADER = "jobfence_rate_slot"
PASSTHROUGH = (Retry, Ignore, Reject)
#: Publish options that make a workflow wait on the published task id (chain, group, chord).
WORKFLOW_OPTIONS = ("chain", "link", "link_error", "chord", "group_id")
#: Outcomes that end a delivery with no result of its own: the typed stop each raises, so a
#: chain, group, chord or link never takes a marker as the task's result (design §9).
_STOPS: dict[str, type[JobSkipped]] = {
    "duplicate": DuplicateSkipped,
    "superseded": JobSuperseded,
    "dropped": JobDropped,
    "rate_skipped": RateLimitSkipped,
}

log = logging.getLogger(__name__)


def _plain_warning(logger: logging.Logger, msg: str, *args: object) -> None:
    logger.warning(msg, *args)


class JobNotSettled(TaskError):
    """Eager or direct call: the job's fate is unknown and there is no broker to come back
    through (lock server unavailable, lease lost, commit unanswered). Call it again."""


@dataclass(frozen=True)
class _Delivery:
    """One delivery's outcome and what an action needs to answer it."""

    rt: Runtime
    spec: JobSpec
    out: Outcome
    req: Any
    explicit: str | None
    redeliveries: int

    @property
    def countdown(self) -> float:
        """The outcome's countdown, capped: a countdown the broker would outwait redelivers
        the message while it waits; coming back early only means deferring once more."""
        return min(self.out.countdown, max(0.1, self.rt.settings.visibility_timeout / 2))

    def headers(self, *, deferred: bool = False, redeliveries: int | None = None) -> dict[str, Any]:
        """Headers for this message published again (_copy_headers)."""
        count = self.redeliveries if redeliveries is None else redeliveries
        return _copy_headers(self.req, self.explicit, count, deferred=deferred)


#: Serializers a singleton task may send: JSON, or JSON signed by Celery's `auth` serializer.
SINGLETON_SERIALIZERS = ("json", "auth")


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task that runs at most once at a time per key, and takes effect once.

    Its options (tasks/options.py) are `jobfence_options`, which @singleton_task sets; each
    is an attribute too (`task.on_conflict`; `key=` and `ttl=` are `task.jobfence_key` and
    `task.jobfence_ttl`), which a subclass may set as a class attribute.
    """

    acks_late = True
    reject_on_worker_lost = True
    # JSON, or Celery's `auth` (JSON signed with the app's key) when the app signs its
    # messages (app.setup_security() before the tasks are defined): see on_bound.
    serializer: str | None = None
    throws = (JobSkipped,)  # an expected end: logged as one line, without a traceback
    jobfence_options: ClassVar[TaskOptions] = DEFAULTS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._take_option_attributes()

    @classmethod
    def _take_option_attributes(cls) -> None:
        """Option attributes set on the class itself (`on_conflict = "wait"` in a subclass,
        `app.task(base=SingletonTask, jobfence_key=...)`, Celery's task_annotations) go into
        its options, checked as the decorator's."""
        own = {f.name: attribute_of(f) for f in OPTIONS if attribute_of(f) in vars(cls)}
        if own:
            given = {name: getattr(cls, attribute) for name, attribute in own.items()}
            for attribute in own.values():
                delattr(cls, attribute)  # read from the options from now on
            cls.jobfence_options = dataclasses.replace(cls.jobfence_options, **given)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Follow the app's task_serializer only where it is JSON or signed JSON (`auth`);
        take the options Celery's task_annotations set on the class."""
        super().on_bound(app)
        if cls.serializer not in SINGLETON_SERIALIZERS:
            cls.serializer = "json"
        cls._take_option_attributes()

    # -- what the body sees ------------------------------------------------------
    @property
    def lease(self) -> Lease:
        return current_lease()

    @property
    def job(self) -> JobContext:
        return current_job()

    # -- identity ----------------------------------------------------------------
    def _runtime(self) -> Runtime:
        return runtime_for(self.app)

    def lease_ttl(self, default_ttl: float) -> float:
        """The TTL of this task's leases: its own `ttl=`, else `default_ttl` (the runtime's)."""
        return self.jobfence_options.lease_ttl(default_ttl)

    def identity(self, args: Any, kwargs: Any, explicit: str | None = None) -> tuple[str, str]:
        """(job key, argument fingerprint) for these arguments."""
        # Bound first: a wrong argument is the caller's TypeError, whatever the runtime's state.
        arguments = bind_arguments(self.run, list(args or ()), dict(kwargs or {}), name=self.name)
        return self._identity(self._runtime(), arguments, explicit)

    def _identity(
        self, rt: Runtime, arguments: dict[str, Any], explicit: str | None
    ) -> tuple[str, str]:
        return identity(
            rt.secret, self.name, arguments, selector=self.jobfence_options.key, explicit=explicit
        )

    # -- publishing --------------------------------------------------------------
    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        *rest: Any,
        **options: Any,
    ) -> Any:
        """Like Task.apply_async; also takes `idempotency_key=` (kept in the headers)."""
        headers = dict(options.pop("headers", None) or {})
        explicit = options.pop("idempotency_key", None)
        if explicit is not None:
            if not isinstance(explicit, str) or not explicit:
                raise ArgumentsNotSerializable("idempotency_key must be a non-empty string")
            headers[HEADER] = explicit
        key, _ = self.identity(args, kwargs, headers.get(HEADER))  # refuses non-JSON arguments
        # A delivered message published again (same task id): it holds or held the claim.
        again = bool(headers.pop(REPUBLISHED, None)) or REDELIVERIES in headers
        if self.jobfence_options.dedupe_on_publish and not (self.app.conf.task_always_eager
                                                            or again):  # fmt: skip
            task_id = task_id or uuid()

            def publish() -> Any:
                return super(SingletonTask, self).apply_async(
                    args, kwargs, task_id, *rest, headers=headers, **options
                )

            workflow = any(options.get(name) for name in WORKFLOW_OPTIONS)
            return self._publish_once(key, task_id, self._dedupe_ttl(self._runtime(), options),
                                      publish, workflow=workflow)  # fmt: skip
        return super().apply_async(args, kwargs, task_id, *rest, headers=headers, **options)

    def _publish_once(
        self, key: str, task_id: str, ttl: float, publish: Callable[[], Any], *, workflow: bool
    ) -> Any:
        """Claim the key for `task_id` and publish; a duplicate gets `on_duplicate_publish`
        (tasks/publish.py decides). A workflow's duplicate goes out unclaimed and meets the
        running copy at the gate (docs/explanation/delivery-policy.md)."""
        backend = self._runtime().backend
        flow = publish_flow(key, task_id, ttl, policy=self.jobfence_options.on_duplicate_publish,
                            workflow=workflow, name=self.name)  # fmt: skip
        decision = run_sync(flow, backend, backend.clock)
        if decision.action == "result":
            return self.AsyncResult(decision.holder)
        if decision.action == "unclaimed":
            log.info("%s: a copy is queued or running as task %s; this publish carries a "
                     "workflow, so it goes out and meets that copy at the gate",
                     self.name, decision.holder)  # fmt: skip
            return publish()
        try:
            out = publish()
        except BaseException:
            # Nothing of ours was queued: the claim goes back, so the next publish goes out.
            flow_back = give_back_flow(key, task_id, ttl, previous=decision.previous)
            if not run_sync(flow_back, backend, backend.clock):
                log.error("%s: replacing task %s failed and its claim could not be given "
                          "back", self.name, decision.previous)  # fmt: skip
            raise
        if decision.previous is not None:
            log.info("%s: task %s replaced queued task %s", self.name, task_id,
                     decision.previous)  # fmt: skip
        return out

    def _dedupe_ttl(self, rt: Runtime, options: dict[str, Any]) -> float:
        base = self.jobfence_options.dedupe_ttl or rt.settings.visibility_timeout
        return base + float(options.get("countdown") or 0)

    # -- executing ---------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request  # a property that walks a thread-local stack: read it once
        if not req.called_directly:
            return self._gated(args, kwargs, req)
        # Called as a plain function: push a request as Celery would, then gate.
        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs)
        try:
            return self._gated(args, kwargs)
        finally:
            self.pop_request()
            _task_stack.pop()

    def _gated(self, args: tuple[Any, ...], kwargs: dict[str, Any], req: Any = None) -> Any:
        req = req if req is not None else self.request
        # Bound before the runtime is asked for: a wrong argument is the caller's TypeError.
        arguments = bind_arguments(self.run, args, kwargs, name=self.name)
        rt = self._runtime()
        headers = req.headers or {}
        fields = _fields(req)
        explicit, redeliveries = _marks(req)
        key, fp = self._identity(rt, arguments, explicit)
        s, o = rt.settings, self.jobfence_options
        spec = JobSpec(
            name=self.name,
            key=key,
            fingerprint=fp,
            task_id=req.id or "",
            failed_message=s.failed_record_message,
            redeliveries=redeliveries,
            suspect=_after_a_crash(req),
            max_crashed=s.max_crashed_deliveries,
            claim_ttl=o.dedupe_ttl or s.visibility_timeout,
            supersede=o.dedupe_on_publish and o.on_duplicate_publish == "replace",
            publish_claim=o.dedupe_on_publish,
            queues=not (req.called_directly or req.is_eager),
            concurrency_key=(
                concurrency_key(rt.secret, self.name, arguments, o.concurrency_key)
                if o.concurrency
                else ""
            ),
            rate=self._rate_spec(rt, arguments, req, headers, fields),
            previous=_previous_identities(self, rt, arguments, explicit),
            **o.job_fields(s),
        )
        try:
            out = rt.executor.run(
                spec, lambda _ctx: self.run(*args, **kwargs), passthrough=PASSTHROUGH
            )
        except PASSTHROUGH:
            raise
        except BaseException:
            if spec.claims:  # owner-checked: the claim may be a newer copy's by now
                # lock_until="start" keeps the claim unmarked until the body starts.
                mine = spec.task_id if spec.claim_at_body else STARTED + spec.task_id
                self._drop_claim(rt, spec, mine)
            elif self.jobfence_options.dedupe_on_publish:
                # A failed job may be submitted afresh; owner-checked, as a copy published
                # around the claim (a workflow's duplicate) must not free the holder's claim.
                self._drop_claim(rt, spec, spec.task_id)
            raise
        return self.ACTIONS[out.status](self, _Delivery(rt, spec, out, req, explicit, redeliveries))

    def _drop_claim(self, rt: Runtime, spec: JobSpec, mine: str) -> None:
        """Drop the publish claim of a delivery that ends without running (or failed), never
        letting the lock server's failure replace the delivery's own outcome: the claim then
        expires by its TTL, and until then a publish of the key answers with this task's
        (visible) result. The body's own fate is already settled (design section 7)."""
        try:
            rt.backend.execute(SwapPublish(spec.key, mine, None, spec.claim_ttl))
        except Exception as exc:  # the cleanup's failure, whatever it is, must not win
            log.warning("%s: publish claim not cleared (%s); it expires by its TTL",
                        self.name, type(exc).__name__)  # fmt: skip

    def _rate_spec(
        self, rt: Runtime, arguments: dict[str, Any], req: Any, headers: Any, fields: Any
    ) -> RateSpec | None:
        """The job's global rate limit, if the task has one: limiter key, policy, turn."""
        o = self.jobfence_options
        rate = o.rate
        if rate is None:
            return None
        if not rt.backend.capabilities.rate_limit:
            raise RateLimitUnsupported(
                f"{self.name} has global_rate_limit={str(rate)!r}, but the "
                f"{rt.backend.name} lock backend keeps no shared rate limits; use "
                f"{backends_with('rate_limit')}"
            )
        if o.rate_key is None:
            limiter = self.name
        else:  # a digest of the chosen arguments, never the arguments themselves
            limiter = job_key(rt.secret, self.name, arguments, selector=o.rate_key)
        policy, wait = o.on_rate_limited, o.wait_timeout
        if policy == "retry" and (req.called_directly or req.is_eager):
            policy, wait = "wait", RATE_HORIZON  # no broker to come back through: wait here
        slot = headers.get(RATE_SLOT_HEADER) or fields.get(RATE_SLOT_HEADER)
        return RateSpec(
            key=limiter,
            label=self.name,
            interval=rate.interval,
            burst=rate.burst,
            on_limited=policy,
            wait_timeout=rt.settings.acquire_timeout if wait is None else wait,
            slot=float(slot) if slot else None,
        )

    # -- the outcome table: one action per executor status ------------------------
    def _return_value(self, d: _Delivery) -> Any:
        """The job ran, or its DONE record answers: its result."""
        return d.out.value

    def _stop(self, d: _Delivery) -> Any:
        """No result of its own: the typed stop (a superseded copy may answer with DONE)."""
        return _result_of(d.rt, d.spec, d.out)

    def _follow_or_stop(self, d: _Delivery) -> Any:
        """A duplicate: come back for the running copy's result where `_follows`; else the
        typed stop."""
        req, spec, out = d.req, d.spec, d.out
        if self._follows(req, spec, out):
            # Back once the running copy's lease would have ended, when its DONE record
            # answers; if that copy failed, the comeback runs the job, as a fresh publish would.
            countdown = min(spec.ttl, max(0.1, d.rt.settings.visibility_timeout / 2))
            log.info("%s[%s]: a copy runs as task %s; this one comes back for its result",
                     self.name, req.id, out.holder)  # fmt: skip
            self._publish_again(req, countdown, d.headers())
        return self._stop(d)

    def _follows(self, req: Any, spec: JobSpec, out: Outcome) -> bool:
        """Whether a skipped duplicate waits for the running copy's result: only where a
        workflow needs data from it (a chain, group, chord or link), through a broker, and
        where that copy's DONE record will answer this very job (not a run of its own)."""
        return bool(
            out.holder
            and self.jobfence_options.on_conflict == "skip"
            and not (spec.per_run or spec.claims)
            and not (req.called_directly or req.is_eager)
            and (req.callbacks or req.chain or req.chord or req.group)
        )

    def _skip_rate(self, d: _Delivery) -> Any:
        """No rate turn free (on_rate_limited="skip"): it never ran, so a new submission may
        go out (the claim is freed), then the typed stop."""
        if self.jobfence_options.dedupe_on_publish:
            self._drop_claim(d.rt, d.spec, d.spec.task_id)
        return self._stop(d)

    def _defer(self, d: _Delivery) -> NoReturn:
        """Our own earlier delivery holds the lease: come back after it ends, and let this
        copy go without a result (the real one is stored under the same id); a grant of the
        copy counts towards the poison cap."""
        self._publish_again(d.req, d.countdown, d.headers(deferred=True))

    def _republish_at_turn(self, d: _Delivery) -> NoReturn:
        """Rate-limited: publish this message again for its turn (same id, counted neither
        as a Celery retry nor as a redelivery) and ack this one."""
        headers = d.headers()
        if d.out.slot is not None:
            headers[RATE_SLOT_HEADER] = d.out.slot
        self._publish_again(d.req, d.countdown, headers)

    def _celery_retry(self, d: _Delivery) -> NoReturn:
        """on_conflict="retry": a Celery retry, counted against max_retries."""
        raise self.retry(countdown=d.countdown)

    def _requeue(self, d: _Delivery) -> NoReturn:
        """No concurrency slot came free in time, or (lock_until="start") another run of the
        key holds it: publish this message again (same id, key and counts; neither a retry
        nor a redelivery), then ack this one."""
        if d.req.called_directly or d.req.is_eager:
            raise JobNotSettled(f"{d.out.reason}; call it again", fence=d.out.fence)
        self._publish_again(d.req, d.countdown, d.headers())

    def _redeliver(self, d: _Delivery) -> NoReturn:
        """The job's fate is unknown: publish this message again, same id and key, its
        redelivery count (apart from `max_retries`) one more. A new message survives a
        broker restart and carries its countdown and count."""
        req, out = d.req, d.out
        if req.called_directly or req.is_eager:
            raise JobNotSettled(f"{out.reason}; call it again", key=d.spec.key, fence=out.fence)
        # An outage redelivers every job at once: those lines go through the outage limiter.
        warn = OUTAGE.warning if "unavailable" in out.reason else _plain_warning
        warn(log, "redelivering %s[%s] in %.2fs (redelivery %d): %s",
             self.name, req.id, d.countdown, d.redeliveries + 1, out.reason)  # fmt: skip
        self._publish_again(req, d.countdown, d.headers(redeliveries=d.redeliveries + 1))

    #: Every executor status to its Celery action (design §8): return the value, raise a
    #: typed stop, publish again (which headers, when), retry, redeliver, follow a copy.
    ACTIONS: ClassVar[dict[Status, Callable[[SingletonTask, _Delivery], Any]]] = {
        "ran": _return_value,
        "replayed": _return_value,
        "duplicate": _follow_or_stop,
        "superseded": _stop,
        "dropped": _stop,
        "rate_skipped": _skip_rate,
        "defer": _defer,
        "rate_limited": _republish_at_turn,
        "retry": _celery_retry,
        "requeue": _requeue,
        "redeliver": _redeliver,
    }

    def _publish_again(self, req: Any, countdown: float, headers: dict[str, Any]) -> NoReturn:
        """Publish the delivered message `req` again (same id; `headers` from _copy_headers,
        so no publish claim is made for it), then ack this delivery. If the publish fails,
        the message goes back to the broker instead (Reject with requeue): never dropped."""
        try:
            self.signature_from_request(req, countdown=countdown, headers=headers).apply_async()
        except Exception as exc:
            log.warning("re-publish of %s[%s] failed (%s): requeued", self.name, req.id, exc)
            raise Reject(exc, requeue=True) from exc
        raise Ignore()

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Release our lease before the retry is published, so it never waits on itself."""
        req = self.request
        limit = self.max_retries if max_retries is None else max_retries
        final = limit is not None and req.retries + 1 > limit
        if not final and not req.called_directly and not req.is_eager:
            try:
                job = current_job()
            except LockError:  # no body running (a conflict retry): no lease to release
                job = None
            if job is not None:
                try:
                    self._runtime().executor.release(job.lease)
                except BackendUnavailable:
                    # The lock server does not answer now: the retry goes out all the same,
                    # and the lease it would have freed ends at its TTL (the retried copy,
                    # this task id, defers until then). A retry never fails on its release.
                    log.warning("task %s: its lease could not be released before its retry "
                                "(lock server not answering); it ends at its TTL", self.name)
        if not req.called_directly and not req.is_eager:
            # The retry is this delivered message again: marked, never de-duplicated away.
            explicit, redeliveries = _marks(req)
            copied = _copy_headers(req, explicit, redeliveries, deferred=False)
            options["headers"] = {**copied, **(options.get("headers") or {}), REPUBLISHED: 1}
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)


#: Each option an attribute of the task too (`task.on_conflict`), read from its options.
add_option_attributes(SingletonTask, "jobfence_options")


def _previous_identities(
    task: SingletonTask, rt: Runtime, arguments: dict[str, Any], explicit: str | None
) -> tuple[tuple[str, str], ...]:
    """(key, fingerprint) of the job under each earlier secret (JOBFENCE_KEY_SECRET_PREVIOUS)."""
    return tuple(
        identity(old, task.name, arguments, selector=task.jobfence_options.key, explicit=explicit)
        for old in rt.previous_secrets
    )


def _result_of(rt: Runtime, spec: JobSpec, out: Outcome) -> Any:
    """What the caller and the workflow get: the job's own result (ran, replayed), else the
    typed stop. A superseded copy answers with the job's DONE record when it is already
    there (the newer holder ran this very job), as a later delivery would."""
    stop = _STOPS.get(out.status)
    if stop is None:
        return out.value
    if out.status == "superseded":
        with contextlib.suppress(BackendUnavailable):  # no answer: the typed stop says why
            record = rt.backend.job_record(spec.key)
            if (
                record is not None
                and record.state == "DONE"
                and record.fingerprint == spec.record_fingerprint
            ):
                return json.loads(record.result) if record.result else None
    reason = _STOP_REASONS[out.status]
    if stop is DuplicateSkipped:
        held = f" (task {out.holder})" if out.holder else ""
        raise DuplicateSkipped(f"{spec.name}: {reason}{held}", out.holder, key=spec.key)
    if stop is RateLimitSkipped:
        after = float((out.value or {}).get("retry_after", 0.0))
        raise RateLimitSkipped(f"{spec.name}: {reason} (retry after {after:g}s)", after,
                               key=spec.key)  # fmt: skip
    raise stop(f"{spec.name}: {reason}", key=spec.key)


_STOP_REASONS = {
    "duplicate": "a copy of this job is running, or ran within unique_for; acked without "
    "running (on_conflict='skip'); that copy's AsyncResult answers with the result",
    "superseded": "a newer copy took this job over before its result was on record",
    "dropped": "the lease was lost mid-body and the job is not run again "
    "(on_lease_lost='drop'); it may have run in part",
    "rate_skipped": "no global rate limit turn was free; not run (on_rate_limited='skip')",
}


def _copy_headers(
    req: Any, explicit: str | None, redeliveries: int, *, deferred: bool
) -> dict[str, Any]:
    """Headers for a copy of this message published again: marked as such (REPUBLISHED), the
    same idempotency key (Celery may expose it only as a request attribute) and redelivery
    count; the crash marker only on a deferred copy, so a redelivery never counts towards the
    poison cap by inheritance."""
    # Neither marker is inherited: a reserved rate turn is spent by the copy it was made for.
    headers = {
        k: v for k, v in (req.headers or {}).items() if k not in (DEFERRED_HEADER, RATE_SLOT_HEADER)
    }
    if explicit:
        headers[HEADER] = explicit
    if redeliveries:
        headers[REDELIVERIES] = redeliveries
    if deferred:
        headers[DEFERRED_HEADER] = 1
    headers[REPUBLISHED] = 1
    return headers


def _marks(req: Any) -> tuple[str | None, int]:
    """The delivery's explicit idempotency key and redelivery count, from its headers or (as
    Celery may expose custom headers) its attributes."""
    headers, fields = req.headers or {}, _fields(req)
    explicit = headers.get(HEADER) or fields.get(HEADER)
    return explicit, int(headers.get(REDELIVERIES) or fields.get(REDELIVERIES) or 0)


def _fields(req: Any) -> dict[str, Any]:
    """The request's own attributes. Celery may put a message's custom headers there; read
    as a dict, a missing one costs no AttributeError (getattr with a default raises one)."""
    fields: dict[str, Any] = getattr(req, "__dict__", {})
    return fields


def _after_a_crash(req: Any) -> bool:
    """True if this delivery may follow one that died mid-body: the broker redelivered it
    (acks_late, reject_on_worker_lost, visibility timeout), or it is our deferred copy."""
    info = req.delivery_info or {}
    headers = req.headers or {}
    return bool(
        info.get("redelivered")
        or headers.get("redelivered")
        or headers.get(DEFERRED_HEADER)
        or _fields(req).get(DEFERRED_HEADER)
    )


@overload
def singleton_task(fn: Callable[..., Any], /) -> SingletonTask: ...


@overload
def singleton_task(
    *,
    app: Any = None,
    key: KeySelector = None,
    ttl: float | None = None,
    on_conflict: ConflictPolicy = "skip",
    on_lease_lost: LeaseLostPolicy = "redeliver",
    wait_timeout: float | None = None,
    result_ttl: float | None = None,
    dedupe_on_publish: bool = False,
    dedupe_ttl: float | None = None,
    lock_until: LockUntil = "finish",
    unique_for: float | None = None,
    on_duplicate_publish: DuplicatePublishPolicy = "result",
    concurrency: int = 0,
    concurrency_key: KeySelector = None,
    global_rate_limit: str | None = None,
    rate_key: KeySelector = None,
    rate_burst: int = 1,
    on_rate_limited: RateLimitedPolicy = "retry",
    base: type[SingletonTask] = SingletonTask,
    **celery_options: Any,
) -> Callable[[Callable[..., Any]], SingletonTask]: ...


def singleton_task(
    *fn: Callable[..., Any],
    app: Any = None,
    base: type[SingletonTask] = SingletonTask,
    **options: Any,
) -> Any:
    """Like `shared_task` (or `app.task` with `app=`), gated by jobfence.

    `key`: the argument name (`"payment_id"`), argument names, or a callable of the
    arguments that make a job unique; a name that is no parameter is refused here;
    `on_conflict`: skip | wait | retry | raise. `on_lease_lost`: redeliver (default: a lease
    lost with no proof of a newer holder delivers the job again) | drop (at most once, for
    effects that cannot be fenced). `lock_until` (finish | start), `unique_for` (seconds)
    and `on_duplicate_publish` (result | raise | replace): see docs/explanation/lifetimes.md.
    `concurrency=N`: at most N jobs of one group run at once across
    the fleet, the group named by the arguments in `concurrency_key` (None: the whole task);
    each job still keeps its own key.
    `global_rate_limit="100/m"`: at most that many starts across the fleet (per `rate_key`
    arguments, if given; `rate_burst` at once after an idle spell); `on_rate_limited`: retry
    (default: re-published for its reserved turn) | wait (up to `wait_timeout` in the
    worker) | skip. Every option is checked here (tasks/options.py is their table). Celery's
    task options pass through unchanged; a keyword that is neither is refused, naming the
    nearest valid one.
    """
    given, celery_options = split_options(options)
    known = celery_option_names(base)
    refuse_unknown("@singleton_task", set(celery_options) - known, {*OPTION_NAMES, *known},
                   "neither a jobfence option nor a Celery task option (a custom task "
                   "attribute belongs on a base class: base=...)")  # fmt: skip
    checked = TaskOptions(**given)
    if celery_options.get("serializer", "json") not in SINGLETON_SERIALIZERS:
        raise TaskDefinitionError(
            "singleton tasks use the json serializer (or auth, Celery's signed JSON); pickle "
            "runs broker data"
        )
    attributes = {"base": base, "jobfence_options": checked, **celery_options}

    def decorate(func: Callable[..., Any]) -> Any:
        checked.check_names(func, bound=bool(celery_options.get("bind")))
        return (app.task(**attributes) if app is not None else shared_task(**attributes))(func)

    if fn:
        return decorate(fn[0])
    return decorate
