"""The Celery side: SingletonTask and @singleton_task gate every delivery through the executor."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, overload

from celery import Task, shared_task
from celery._state import _task_stack
from celery.exceptions import Ignore, Reject, Retry

from jobfence.locks.errors import LockError
from jobfence.locks.lease import Lease
from jobfence.tasks.celery_publish import (
    OUTBOX_OPTION,
    debounce_countdown,
    publish_again,
    publish_once,
)
from jobfence.tasks.celery_spec import delivery_spec, previous_identities, request_fields
from jobfence.tasks.context import JobContext, current_job, current_lease
from jobfence.tasks.errors import (
    ArgumentsNotSerializable,
    JobNotSettled,
    JobSkipped,
    TaskDefinitionError,
)
from jobfence.tasks.flow.marks import KEY_HEADER, REPUBLISHED_HEADER, Marks
from jobfence.tasks.flow.verdict import ComeBack, NotSettled, Stop, Value
from jobfence.tasks.keys import KeySelector, bind_arguments, identity
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
from jobfence.tasks.publish import ordered_id
from jobfence.tasks.runtime import Runtime, runtime_for

#: The header of an explicit idempotency key (`apply_async(idempotency_key=...)`).
HEADER = KEY_HEADER
PASSTHROUGH = (Retry, Ignore, Reject)


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

    def _earlier_keys(self, args: Any, kwargs: Any, explicit: str | None) -> tuple[str, ...]:
        """The job's keys under the earlier secrets of a rotation, where a publish that
        replaces started runs (supersede, debounce) claims too; () otherwise."""
        rt = self._runtime()
        if not (rt.previous_secrets and self.jobfence_options.replaces_started):
            return ()
        arguments = bind_arguments(self.run, list(args or ()), dict(kwargs or {}), name=self.name)
        return tuple(key for key, _ in previous_identities(self, rt, arguments, explicit))

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
        # Sent from the outbox after its commit: a duplicate cannot be refused to a caller
        # any more, nor answered with another task id; it goes out and meets the holder at
        # the gate (a typed stop naming it, or its DONE record), as a workflow's does.
        written = options.pop(OUTBOX_OPTION, None)  # the row's time, from the outbox
        committed = None if written is None else float(written)
        key, _ = self.identity(args, kwargs, headers.get(HEADER))  # refuses non-JSON arguments
        # A delivered message published again (same task id): it holds or held the claim.
        again = Marks.republished(headers)
        headers.pop(REPUBLISHED_HEADER, None)
        if self.jobfence_options.dedupe_on_publish and not (self.app.conf.task_always_eager
                                                            or again):  # fmt: skip
            task_id = task_id or ordered_id()
            if self.jobfence_options.debounce is not None and not (
                "countdown" in options or "eta" in options  # a retry's, or the caller's own
            ):
                options["countdown"] = debounce_countdown(self, key)

            def publish() -> Any:
                return super(SingletonTask, self).apply_async(
                    args, kwargs, task_id, *rest, headers=headers, **options
                )

            earlier = self._earlier_keys(args, kwargs, headers.get(HEADER))
            return publish_once(self, key, task_id, options, publish, committed=committed,
                                earlier=earlier)  # fmt: skip
        return super().apply_async(args, kwargs, task_id, *rest, headers=headers, **options)

    # -- publishing on commit (tasks/outbox.py) -------------------------------------
    def delay_on_commit(self, *args: Any, **kwargs: Any) -> Any:
        """`delay`, durably, once the caller's Django transaction commits."""
        return self.apply_async_on_commit(args, kwargs)

    def apply_async_on_commit(
        self,
        args: Any = None,
        kwargs: Any = None,
        *,
        session: Any = None,
        using: str | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        """Write the message to the outbox in the caller's transaction (an SQLAlchemy
        `session=`, else Django's connection `using`) and publish it once that commits;
        nothing on a rollback. The AsyncResult of the task id chosen now."""
        from jobfence.tasks import outbox  # SQLAlchemy: loaded on use

        entry = outbox.entry_for(self, args, kwargs, options, task_id or ordered_id())
        if session is not None:
            outbox.on_commit_sqlalchemy(self, entry, session)
        elif _django_configured():
            outbox.on_commit_django(self.app, entry, using)
        else:
            raise TypeError(
                f"{self.name}.apply_async_on_commit: no transaction to publish on the commit "
                "of: pass session= (an SQLAlchemy Session), or call it in a Django project "
                "(inside transaction.atomic())"
            )
        return self.AsyncResult(entry.task_id)

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
        spec = delivery_spec(self, rt, arguments, req)
        verdict = rt.executor.deliver(
            spec, lambda _ctx: self.run(*args, **kwargs), passthrough=PASSTHROUGH
        )
        match verdict:  # the flow decided (tasks/flow/verdict.py); here it is carried out
            case Value(value=value):
                return value
            case Stop(error=error):
                raise error
            case ComeBack(retry=True):
                raise self.retry(countdown=verdict.countdown)
            case ComeBack(countdown=countdown, marks=copy):
                publish_again(self, req, countdown, copy.onto(req.headers))
            case NotSettled(reason=reason, fence=fence):
                raise JobNotSettled(f"{reason}; call it again", key=spec.key, fence=fence)

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
        """Give the lease back before the retry is published, so it never waits on itself."""
        req = self.request
        limit = self.max_retries if max_retries is None else max_retries
        final = limit is not None and req.retries + 1 > limit
        if not req.called_directly and not req.is_eager:
            if not final:
                try:
                    job = current_job()
                except LockError:  # no body running (a conflict retry): no lease to give back
                    job = None
                if job is not None:
                    job.release_now()  # the job's flow; unanswered, the lease ends at its TTL
            # The retry is this delivered message again: marked, never de-duplicated away.
            copied = Marks.read(req.headers, request_fields(req)).copy().onto(req.headers)
            options["headers"] = {**copied, **(options.get("headers") or {}),
                                  REPUBLISHED_HEADER: 1}  # fmt: skip
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)


#: Each option an attribute of the task too (`task.on_conflict`), read from its options.
add_option_attributes(SingletonTask, "jobfence_options")



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
    debounce: float | None = None,
    debounce_max_wait: float | None = None,
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
    attributes = _task_attributes(base, options)
    checked: TaskOptions = attributes["jobfence_options"]

    def decorate(func: Callable[..., Any]) -> Any:
        checked.check_names(func, bound=bool(attributes.get("bind")))
        return (app.task(**attributes) if app is not None else shared_task(**attributes))(func)

    if fn:
        return decorate(fn[0])
    return decorate


def _task_attributes(base: type[SingletonTask], options: dict[str, Any]) -> dict[str, Any]:
    """The task class's attributes from the decorator's keywords: the jobfence options
    checked (`jobfence_options`), Celery's passed through; a keyword that is neither is
    refused, and so is a serializer other than JSON or signed JSON."""
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
    return {"base": base, "jobfence_options": checked, **celery_options}


def _django_configured() -> bool:
    """Whether this process runs a configured Django project (without importing Django
    where it is not installed)."""
    import sys

    conf = sys.modules.get("django.conf")
    return conf is not None and bool(conf.settings.configured)
