"""The Celery side: SingletonTask and @singleton_task gate every delivery through the executor."""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Callable
from typing import Any, overload

from celery import Task, shared_task
from celery._state import _task_stack
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid

from jobfence.locks.errors import LockError
from jobfence.locks.lease import Lease
from jobfence.tasks.context import JobContext, current_job, current_lease
from jobfence.tasks.errors import ArgumentsNotSerializable, TaskDefinitionError, TaskError
from jobfence.tasks.executor import (
    CONFLICT_POLICIES,
    LEASE_LOST_POLICIES,
    ConflictPolicy,
    JobSpec,
    LeaseLostPolicy,
    Outcome,
)
from jobfence.tasks.keys import KeySelector, bind_arguments, identity
from jobfence.tasks.runtime import Runtime, runtime_for

HEADER = "jobfence_idempotency_key"
#: How often the job came back because its fate was unknown (apart from Celery's retries).
REDELIVERIES = "jobfence_redeliveries"
#: Set on the copy a delivery re-publishes when its own earlier delivery holds the lease
#: (it crashed, or still runs): a grant of that copy counts towards the poison cap.
DEFERRED_HEADER = "jobfence_deferred"
PASSTHROUGH = (Retry, Ignore, Reject)
_COME_BACK = frozenset({"defer", "retry", "redeliver"})  # outcomes that publish the job again

log = logging.getLogger(__name__)


class JobNotSettled(TaskError):
    """Eager or direct call: the job's fate is unknown and there is no broker to come back
    through (lock server unavailable, lease lost, commit unanswered). Call it again."""


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task that runs at most once at a time per key, and takes effect once.

    Options (class attributes, or keywords of @singleton_task): `jobfence_key`,
    `jobfence_ttl`, `on_conflict`, `wait_timeout`, `result_ttl`, `dedupe_on_publish`,
    `on_lease_lost`.
    """

    acks_late = True
    reject_on_worker_lost = True
    serializer = "json"
    jobfence_key: KeySelector = None
    jobfence_ttl: float | None = None
    on_conflict: ConflictPolicy = "skip"
    on_lease_lost: LeaseLostPolicy = "redeliver"
    wait_timeout: float | None = None
    result_ttl: float | None = None
    dedupe_on_publish: bool = False
    dedupe_ttl: float | None = None

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
        redelivery = REDELIVERIES in headers  # the same task id again: no claim to make
        if self.dedupe_on_publish and not self.app.conf.task_always_eager and not redelivery:
            task_id = task_id or uuid()
            rt = self._runtime()
            held = rt.backend.claim_publish(key, task_id, self._dedupe_ttl(rt, options))
            if held is not None:
                return self.AsyncResult(held)
            try:
                return super().apply_async(args, kwargs, task_id, *rest, headers=headers, **options)
            except BaseException:
                rt.backend.clear_publish(key)  # nothing was queued: the next publish must go out
                raise
        return super().apply_async(args, kwargs, task_id, *rest, headers=headers, **options)

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
        explicit = headers.get(HEADER) or fields.get(HEADER)
        redeliveries = int(headers.get(REDELIVERIES) or fields.get(REDELIVERIES) or 0)
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
        )
        try:
            out = rt.executor.run(
                spec, lambda _ctx: self.run(*args, **kwargs), passthrough=PASSTHROUGH
            )
        except PASSTHROUGH:
            raise
        except BaseException:
            if self.dedupe_on_publish:
                rt.backend.clear_publish(key)  # a failed job may be submitted afresh
            raise
        if out.status not in _COME_BACK:
            return out.value
        # A countdown the broker would outwait redelivers the message while it waits;
        # coming back early only means deferring once more.
        countdown = min(out.countdown, max(0.1, s.visibility_timeout / 2))
        if out.status == "defer":
            # Our own earlier delivery holds the lease: come back after it ends, and let
            # this copy go without a result (the real one is stored under the same id).
            headers = _copy_headers(req, explicit, redeliveries, deferred=True)
            self.signature_from_request(req, countdown=countdown, headers=headers).apply_async()
            raise Ignore()
        if out.status == "retry":
            raise self.retry(countdown=countdown)
        if out.status == "redeliver":
            self._redeliver(out, key, explicit, redeliveries, countdown)
        return out.value

    def _redeliver(
        self, out: Outcome, key: str, explicit: str | None, redeliveries: int, countdown: float
    ) -> None:
        """Publish this message again, same id and key, counted apart from `max_retries`.

        A new message survives a broker restart and carries its countdown and count; the
        current one is then acked (Ignore). If the publish fails, the current message goes
        back to the broker instead (Reject with requeue): never dropped.
        """
        req = self.request
        if req.called_directly or req.is_eager:
            raise JobNotSettled(f"{out.reason}; call it again", key=key, fence=out.fence)
        headers = _copy_headers(req, explicit, redeliveries + 1, deferred=False)
        log.warning(
            "redelivering %s[%s] in %.2fs (redelivery %d): %s",
            self.name,
            req.id,
            countdown,
            redeliveries + 1,
            out.reason,
        )
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
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)


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


def _copy_headers(
    req: Any, explicit: str | None, redeliveries: int, *, deferred: bool
) -> dict[str, Any]:
    """Headers for a copy of this message published again: the same idempotency key (Celery
    may expose it only as a request attribute) and redelivery count; the crash marker only
    on a deferred copy, so a redelivery never counts towards the poison cap by inheritance."""
    headers = {k: v for k, v in (req.headers or {}).items() if k != DEFERRED_HEADER}
    if explicit:
        headers[HEADER] = explicit
    if redeliveries:
        headers[REDELIVERIES] = redeliveries
    if deferred:
        headers[DEFERRED_HEADER] = 1
    return headers


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
    base: type[SingletonTask] = SingletonTask,
    **celery_options: Any,
) -> Any:
    """Like `shared_task` (or `app.task` with `app=`), gated by jobfence.

    `key`: the argument name (`"payment_id"`), argument names, or a callable of the
    arguments that make a job unique; a name that is no parameter is refused here;
    `on_conflict`: skip | wait | retry | raise. `on_lease_lost`: redeliver (default: a lease
    lost with no proof of a newer holder delivers the job again) | drop (at most once, for
    effects that cannot be fenced). Celery options pass through unchanged.
    """
    if on_conflict not in CONFLICT_POLICIES:
        raise TaskDefinitionError(
            f"on_conflict must be one of {CONFLICT_POLICIES}, got {on_conflict!r}"
        )
    if on_lease_lost not in LEASE_LOST_POLICIES:
        raise TaskDefinitionError(
            f"on_lease_lost must be one of {LEASE_LOST_POLICIES}, got {on_lease_lost!r}; "
            "'drop' runs the job at most once, 'redeliver' (the default) never loses it"
        )
    for name, value in (("ttl", ttl), ("wait_timeout", wait_timeout), ("result_ttl", result_ttl)):
        if value is not None and value <= 0 and not (name == "wait_timeout" and value == 0):
            raise TaskDefinitionError(f"{name} must be positive seconds, got {value!r}")
    if celery_options.get("serializer", "json") != "json":
        raise TaskDefinitionError(
            "singleton tasks use the json serializer; pickle runs broker data"
        )
    key = _normalise_key(key)
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
        **celery_options,
    }

    def decorate(func: Callable[..., Any]) -> Any:
        _check_key_names(func, key, bound=bool(celery_options.get("bind")))
        return (app.task(**options) if app is not None else shared_task(**options))(func)

    if fn:
        return decorate(fn[0])
    return decorate
