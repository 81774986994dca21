"""The Celery side: SingletonTask and @singleton_task gate every delivery through the executor."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import logging
import math
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
from jobfence.locks.ratelimit import Rate, parse_rate
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
from jobfence.tasks.executor import (
    CONFLICT_POLICIES,
    LEASE_LOST_POLICIES,
    LOCK_UNTIL,
    RATE_HORIZON,
    RATE_LIMITED_POLICIES,
    STARTED,
    ConflictPolicy,
    JobSpec,
    LeaseLostPolicy,
    LockUntil,
    Outcome,
    RateLimitedPolicy,
    RateSpec,
    Status,
)
from jobfence.tasks.keys import (
    KeySelector,
    bind_arguments,
    concurrency_key,
    identity,
    job_key,
)
from jobfence.tasks.publish import DuplicatePublishPolicy, give_back_flow, publish_flow
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
DUPLICATE_PUBLISH_POLICIES: tuple[str, ...] = ("result", "raise", "replace")
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

    Options (class attributes, or keywords of @singleton_task): `jobfence_key`,
    `jobfence_ttl`, `on_conflict`, `wait_timeout`, `result_ttl`, `dedupe_on_publish`,
    `on_lease_lost`, `lock_until`, `unique_for`, `on_duplicate_publish`, `concurrency`,
    `concurrency_key`.
    """

    acks_late = True
    reject_on_worker_lost = True
    # JSON, or Celery's `auth` (JSON signed with the app's key) when the app signs its
    # messages (app.setup_security() before the tasks are defined): see on_bound.
    serializer: str | None = None
    throws = (JobSkipped,)  # an expected end: logged as one line, without a traceback
    jobfence_key: KeySelector = None
    jobfence_ttl: float | None = None
    on_conflict: ConflictPolicy = "skip"
    on_lease_lost: LeaseLostPolicy = "redeliver"
    wait_timeout: float | None = None
    result_ttl: float | None = None
    dedupe_on_publish: bool = False
    dedupe_ttl: float | None = None
    lock_until: LockUntil = "finish"
    unique_for: float | None = None
    on_duplicate_publish: DuplicatePublishPolicy = "result"
    concurrency: int = 0  # at most this many jobs of one concurrency group at once (0: any)
    concurrency_key: KeySelector = None  # the arguments naming the group (None: the task)
    global_rate_limit: Rate | None = None
    rate_key: KeySelector = None
    on_rate_limited: RateLimitedPolicy = "retry"

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Follow the app's task_serializer only where it is JSON or signed JSON (`auth`)."""
        super().on_bound(app)
        if cls.serializer not in SINGLETON_SERIALIZERS:
            cls.serializer = "json"

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

    def identity(self, args: Any, kwargs: Any, explicit: str | None = None) -> tuple[str, str]:
        """(job key, argument fingerprint) for these arguments."""
        # Bound first: a wrong argument is the caller's TypeError, whatever the runtime's state.
        arguments = bind_arguments(self.run, list(args or ()), dict(kwargs or {}), name=self.name)
        return self._identity(self._runtime(), arguments, explicit)

    def _identity(
        self, rt: Runtime, arguments: dict[str, Any], explicit: str | None
    ) -> tuple[str, str]:
        return identity(
            rt.secret, self.name, arguments, selector=self.jobfence_key, explicit=explicit
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
        if self.dedupe_on_publish and not self.app.conf.task_always_eager and not again:
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
        running copy at the gate (README "Using it with Celery")."""
        backend = self._runtime().backend
        flow = publish_flow(key, task_id, ttl, policy=self.on_duplicate_publish,
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
        base = self.dedupe_ttl or rt.settings.visibility_timeout
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
        s = rt.settings
        spec = JobSpec(
            name=self.name,
            key=key,
            fingerprint=fp,
            task_id=req.id or "",
            ttl=self.jobfence_ttl or s.default_ttl,
            result_ttl=self.result_ttl or s.result_ttl,
            on_conflict=self.on_conflict,
            wait_timeout=s.acquire_timeout if self.wait_timeout is None else self.wait_timeout,
            on_lease_lost=self.on_lease_lost,
            redeliveries=redeliveries,
            suspect=_after_a_crash(req),
            max_crashed=s.max_crashed_deliveries,
            lock_until=self.lock_until,
            unique_for=self.unique_for or 0.0,
            claim_ttl=self.dedupe_ttl or s.visibility_timeout,
            supersede=self.dedupe_on_publish and self.on_duplicate_publish == "replace",
            publish_claim=self.dedupe_on_publish,
            queues=not (req.called_directly or req.is_eager),
            concurrency=self.concurrency,
            concurrency_key=(
                concurrency_key(rt.secret, self.name, arguments, self.concurrency_key)
                if self.concurrency
                else ""
            ),
            rate=self._rate_spec(rt, arguments, req, headers, fields),
            previous=_previous_identities(self, rt, arguments, explicit),
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
            elif self.dedupe_on_publish:
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
        rate = self.global_rate_limit
        if rate is None:
            return None
        if not rt.backend.capabilities.rate_limit:
            raise RateLimitUnsupported(
                f"{self.name} has global_rate_limit={str(rate)!r}, but the "
                f"{rt.backend.name} lock backend keeps no shared rate limits; use "
                f"{backends_with('rate_limit')}"
            )
        if self.rate_key is None:
            limiter = self.name
        else:  # a digest of the chosen arguments, never the arguments themselves
            limiter = job_key(rt.secret, self.name, arguments, selector=self.rate_key)
        policy, wait = self.on_rate_limited, self.wait_timeout
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
            and self.on_conflict == "skip"
            and not (spec.per_run or spec.claims)
            and not (req.called_directly or req.is_eager)
            and (req.callbacks or req.chain or req.chord or req.group)
        )

    def _skip_rate(self, d: _Delivery) -> Any:
        """No rate turn free (on_rate_limited="skip"): it never ran, so a new submission may
        go out (the claim is freed), then the typed stop."""
        if self.dedupe_on_publish:
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
                self._runtime().executor.release(job.lease)
        if not req.called_directly and not req.is_eager:
            # The retry is this delivered message again: marked, never de-duplicated away.
            explicit, redeliveries = _marks(req)
            copied = _copy_headers(req, explicit, redeliveries, deferred=False)
            options["headers"] = {**copied, **(options.get("headers") or {}), REPUBLISHED: 1}
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)


def _previous_identities(
    task: SingletonTask, rt: Runtime, arguments: dict[str, Any], explicit: str | None
) -> tuple[tuple[str, str], ...]:
    """(key, fingerprint) of the job under each earlier secret (JOBFENCE_KEY_SECRET_PREVIOUS)."""
    return tuple(
        identity(old, task.name, arguments, selector=task.jobfence_key, explicit=explicit)
        for old in rt.previous_secrets
    )


def _check_seconds(name: str, value: Any, *, zero: bool = False) -> None:
    """Refuse an option of seconds that is no finite number > 0 (>= 0 with `zero`); None
    (the setting's default) passes. NaN passes every `<=` test and inf overflows a TTL."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        problem = f"a number of seconds, got {type(value).__name__}"
    elif not math.isfinite(value):
        problem = f"a finite number of seconds, got {value!r}"
    elif value < 0 or (value == 0 and not zero):
        problem = f"{'non-negative' if zero else 'positive'} seconds, got {value!r}"
    else:
        return
    raise TaskDefinitionError(
        f"{name} must be {problem}; pass e.g. {name}=30, or leave it out for the default"
    )


def _check_lifetime(
    lock_until: Any,
    unique_for: Any,
    on_duplicate_publish: Any,
    on_conflict: str,
    dedupe_on_publish: bool,
) -> None:
    """Refuse, at decoration, a lock lifetime or duplicate-publish policy that cannot work."""
    if lock_until not in LOCK_UNTIL:
        raise TaskDefinitionError(
            f"lock_until must be one of {LOCK_UNTIL}, got {lock_until!r}; for a key held a "
            "fixed time after the run, use unique_for=<seconds>"
        )
    _check_seconds("unique_for", unique_for)
    if unique_for is not None and lock_until == "start":
        raise TaskDefinitionError(
            "unique_for keeps the key until a time after the run finishes; it cannot be "
            "combined with lock_until='start' (which frees it when the run starts): pick one"
        )
    if lock_until == "start" and on_conflict == "skip":
        raise TaskDefinitionError(
            "lock_until='start' lets a newer copy queue behind the running one, and "
            "on_conflict='skip' would drop that copy when it arrives during the run; "
            "use on_conflict='wait' or 'retry'"
        )
    if on_duplicate_publish not in DUPLICATE_PUBLISH_POLICIES:
        raise TaskDefinitionError(
            f"on_duplicate_publish must be one of {DUPLICATE_PUBLISH_POLICIES}, "
            f"got {on_duplicate_publish!r}"
        )
    if on_duplicate_publish != "result" and not dedupe_on_publish:
        raise TaskDefinitionError(
            f"on_duplicate_publish={on_duplicate_publish!r} acts on the publish claim, "
            "which only dedupe_on_publish=True makes; set dedupe_on_publish=True"
        )


def _check_concurrency(concurrency: Any, concurrency_key: Any) -> KeySelector:
    """Refuse a limit that is no positive integer, or a group key without a limit."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 0:
        raise TaskDefinitionError(
            f"concurrency must be a positive integer (at most that many jobs of a group at "
            f"once), or 0 for no limit; got {concurrency!r}"
        )
    if concurrency_key is not None and not concurrency:
        raise TaskDefinitionError(
            "concurrency_key names a group but concurrency= sets no limit; add concurrency=N"
        )
    try:
        return _normalise_key(concurrency_key)
    except TaskDefinitionError as exc:
        raise TaskDefinitionError(f"concurrency_{exc}") from None


def _normalise_key(key: Any) -> KeySelector:
    """`key="payment_id"` means that one argument; a list or tuple, those; else a callable."""
    if key is None or callable(key):
        return key  # type: ignore[no-any-return]
    if isinstance(key, str):
        key = (key,)
    if not isinstance(key, list | tuple) or not all(isinstance(k, str) for k in key):
        raise TaskDefinitionError(
            f"key must be an argument name, a list of argument names or a callable, "
            f"got {type(key).__name__}"
        )
    if not key:
        raise TaskDefinitionError(
            "key=[] names no argument, so every call would share one key; "
            "name the arguments that make a job unique, or leave key=None for all of them"
        )
    return tuple(key)


def _check_key_names(func: Callable[..., Any], key: KeySelector, *, bound: bool) -> None:
    """Refuse, at decoration, a key naming something that is not a parameter of `func`, or
    a key callable that cannot take `func`'s arguments by name."""
    if key is None or isinstance(key, str):
        return
    params = list(inspect.signature(func).parameters.values())
    if bound and params:
        params = params[1:]  # `self`, the task: never part of a key
    names = [p.name for p in params]
    if callable(key):
        _check_key_callable(func, key, names)
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return  # any name may arrive through **kwargs
    for k in key:
        if k not in names:
            close = difflib.get_close_matches(k, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TaskDefinitionError(
                f"key names {k!r}, which is not a parameter of "
                f"{func.__name__}({', '.join(names)}){hint}"
            )


def _check_key_callable(
    func: Callable[..., Any], key: Callable[..., Any], names: list[str]
) -> None:
    try:
        inspect.signature(key).bind(**dict.fromkeys(names))
    except TypeError as exc:
        raise TaskDefinitionError(
            f"key callable {getattr(key, '__name__', key)!r} is called with the arguments of "
            f"{func.__name__}({', '.join(names)}) by name, and {exc}; "
            "accept them all (add **_ for those it ignores)"
        ) from None
    except ValueError:  # no signature to read (a builtin): it is tried at publish
        return


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


def _rate_options(
    limit: str | None, rate_key: KeySelector, burst: int, policy: str
) -> tuple[Rate | None, KeySelector]:
    """The parsed global rate limit and its key selector; bad options refused here."""
    if policy not in RATE_LIMITED_POLICIES:
        raise TaskDefinitionError(
            f"on_rate_limited must be one of {RATE_LIMITED_POLICIES}, got {policy!r}"
        )
    if limit is None:
        if rate_key is not None:
            raise TaskDefinitionError("rate_key is given without global_rate_limit; set both")
        return None, None
    try:
        rate = parse_rate(limit, option="global_rate_limit", burst=burst)
    except LockError as exc:
        raise TaskDefinitionError(str(exc).replace("burst", "rate_burst")) from None
    try:
        selector = _normalise_key(rate_key)
    except TaskDefinitionError as exc:
        raise TaskDefinitionError(f"rate_{exc}") from None
    return rate, selector


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
    key: KeySelector = None,
    ttl: float | None = None,
    on_conflict: ConflictPolicy = "skip",
    on_lease_lost: LeaseLostPolicy = "redeliver",
    wait_timeout: float | None = None,
    result_ttl: float | None = None,
    dedupe_on_publish: bool = False,
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
) -> Any:
    """Like `shared_task` (or `app.task` with `app=`), gated by jobfence.

    `key`: the argument name (`"payment_id"`), argument names, or a callable of the
    arguments that make a job unique; a name that is no parameter is refused here;
    `on_conflict`: skip | wait | retry | raise. `on_lease_lost`: redeliver (default: a lease
    lost with no proof of a newer holder delivers the job again) | drop (at most once, for
    effects that cannot be fenced). `lock_until` (finish | start), `unique_for` (seconds)
    and `on_duplicate_publish` (result | raise | replace): see README "Lock lifetimes and
    duplicate publishes". `concurrency=N`: at most N jobs of one group run at once across
    the fleet, the group named by the arguments in `concurrency_key` (None: the whole task);
    each job still keeps its own key.
    `global_rate_limit="100/m"`: at most that many starts across the fleet (per `rate_key`
    arguments, if given; `rate_burst` at once after an idle spell); `on_rate_limited`: retry
    (default: re-published for its reserved turn) | wait (up to `wait_timeout` in the
    worker) | skip. Celery options pass through unchanged.
    """
    _check_lifetime(lock_until, unique_for, on_duplicate_publish, on_conflict, dedupe_on_publish)
    if on_conflict not in CONFLICT_POLICIES:
        raise TaskDefinitionError(
            f"on_conflict must be one of {CONFLICT_POLICIES}, got {on_conflict!r}"
        )
    if on_lease_lost not in LEASE_LOST_POLICIES:
        raise TaskDefinitionError(
            f"on_lease_lost must be one of {LEASE_LOST_POLICIES}, got {on_lease_lost!r}; "
            "'drop' runs the job at most once, 'redeliver' (the default) never loses it"
        )
    _check_seconds("ttl", ttl)
    _check_seconds("wait_timeout", wait_timeout, zero=True)
    _check_seconds("result_ttl", result_ttl)
    _check_seconds("dedupe_ttl", celery_options.get("dedupe_ttl"))
    if celery_options.get("serializer", "json") not in SINGLETON_SERIALIZERS:
        raise TaskDefinitionError(
            "singleton tasks use the json serializer (or auth, Celery's signed JSON); pickle "
            "runs broker data"
        )
    group = _check_concurrency(concurrency, concurrency_key)
    key = _normalise_key(key)
    rate, rate_selector = _rate_options(global_rate_limit, rate_key, rate_burst, on_rate_limited)
    options = {
        "base": base,
        # Options become class attributes: a plain function there would be bound as a method.
        "jobfence_key": staticmethod(key) if callable(key) else key,
        "jobfence_ttl": ttl,
        "on_conflict": on_conflict,
        "on_lease_lost": on_lease_lost,
        "wait_timeout": wait_timeout,
        "result_ttl": result_ttl,
        "dedupe_on_publish": dedupe_on_publish,
        "lock_until": lock_until,
        "unique_for": unique_for,
        "on_duplicate_publish": on_duplicate_publish,
        "concurrency": concurrency,
        "concurrency_key": staticmethod(group) if callable(group) else group,
        "global_rate_limit": rate,
        "rate_key": staticmethod(rate_selector) if callable(rate_selector) else rate_selector,
        "on_rate_limited": on_rate_limited,
        **celery_options,
    }

    def decorate(func: Callable[..., Any]) -> Any:
        _check_key_names(func, key, bound=bool(celery_options.get("bind")))
        try:
            _check_key_names(func, group, bound=bool(celery_options.get("bind")))
        except TaskDefinitionError as exc:
            raise TaskDefinitionError(f"concurrency_{exc}") from None
        try:
            _check_key_names(func, rate_selector, bound=bool(celery_options.get("bind")))
        except TaskDefinitionError as exc:
            raise TaskDefinitionError(f"rate_{exc}") from None
        return (app.task(**options) if app is not None else shared_task(**options))(func)

    if fn:
        return decorate(fn[0])
    return decorate
