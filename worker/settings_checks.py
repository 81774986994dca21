"""Start-up checks judged from the app's settings and tasks alone, without a server:
serialisers, signed messages, security downgrades, delivery, lease TTLs against the visibility
timeout, semaphores, rate limits, and JOBFENCE_* names jobfence never reads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from jobfence.config import security
from jobfence.config.errors import SETTINGS_FIX
from jobfence.config.findings import Finding
from jobfence.config.findings import refuse as _refuse
from jobfence.config.findings import warn as _warn
from jobfence.config.settings import ENV_PREFIX, unknown_django_settings, unknown_variables
from jobfence.locks.registry import backends_with
from jobfence.tasks import Runtime, SingletonTask
from jobfence.worker import broker_tls

UNKNOWN_NAME = "unknown-name"  # a JOBFENCE_* name jobfence never reads (a typo, usually)
JSON_TYPES = ("json", "application/json")
#: Celery's message signing: JSON inside, signed with the app's key (app.setup_security()).
SIGNED_TYPES = ("auth", "application/data")
#: The carrier of Django tasks (tasks.django_tasks.CARRIER; named here, Django is optional).
DJANGO_CARRIER = "jobfence.django_task"


def check_serializers(conf: Any) -> Iterator[Finding]:
    accepted = list(conf.accept_content or ())
    result_accepted = list(conf.result_accept_content or accepted)
    used = [conf.task_serializer, conf.result_serializer, conf.event_serializer]
    safe = (*JSON_TYPES, *SIGNED_TYPES)
    bad = sorted({c for c in [*accepted, *result_accepted, *used] if c not in safe})
    if bad:
        yield _refuse(
            "accept_content / result_accept_content / task_serializer / result_serializer"
            " / event_serializer",
            f"the app accepts or sends {bad}: pickle (and yaml, msgpack extensions) run or "
            "decode arbitrary data from the broker",
            "accept and send only json (or auth, Celery's signed JSON): remove the others "
            "from the app's Celery settings (left unset, jobfence.setup makes them JSON only)",
        )


def check_signed_carrier(conf: Any, tasks: Iterable[Any] = ()) -> Iterator[Finding]:
    """Warn where the app signs its messages and runs Django tasks' carrier: the processes that
    enqueue them must sign too, and accepting plain JSON beside `auth` signs nothing."""
    accepted = [str(c) for c in conf.accept_content or ()]
    signing = conf.task_serializer in SIGNED_TYPES or any(c in SIGNED_TYPES for c in accepted)
    if not signing or DJANGO_CARRIER not in {getattr(t, "name", None) for t in tasks}:
        return
    if any(c in JSON_TYPES for c in accepted):
        yield _warn(
            "accept_content",
            f"the app signs its messages but accepts plain JSON too, so every task (Django's "
            f"through {DJANGO_CARRIER} included) runs unsigned messages: signing is off",
            "accept only auth, and call app.setup_security() in every process that enqueues "
            "(the web process's CeleryBackend app too)",
        )
    else:
        yield _warn(
            "task_serializer",
            f"the app signs its messages and runs Django tasks ({DJANGO_CARRIER}): a process that "
            "enqueues them unsigned (a web process whose Celery app has no setup_security()) "
            "has its jobs dropped by this worker",
            "call app.setup_security() on the Celery app CeleryBackend's OPTIONS name, in "
            "every process that enqueues",
        )

def check_security(conf: Any, runtime: Runtime) -> Iterator[Finding]:
    """Refuse each downgrade (docs/reference/security.md) JOBFENCE_ALLOW_INSECURE does not allow;
    warn about each it does. Judges the settings' URLs and the app's own broker and result
    backend, which need not come from JOBFENCE_*."""
    settings = runtime.settings
    extra = {
        "broker_url": str(conf.broker_url or "") or None,
        "result_backend": str(conf.result_backend or "") or None,
    }
    known = set(settings.server_urls().values())
    extra = {k: v for k, v in extra.items() if v and v not in known}
    found = settings.downgrades(extra, lock_security(runtime))
    judged = {(d.item, d.variable) for d in found}
    # The TLS the broker's and result backend's clients really use (broker_use_ssl, kombu's
    # default), which a rediss:// URL's text does not tell.
    found += [d for d in broker_tls.downgrades(conf, settings)
              if (d.item, d.variable) not in judged]  # fmt: skip
    for d in found:
        if d.item in settings.allow_insecure:
            yield _warn(d.variable, f"{d.problem} ({security.allowed_note(d.item)})", d.fix)
        else:
            yield _refuse(d.variable, d.problem, security.refusal_fix(d))


def lock_security(runtime: Any) -> Any:
    """The lock backend's own account of its connection (`LockBackend.security()`, where a
    backend gives one), or None: then the URL's text is judged."""
    backend = getattr(runtime, "backend", None)
    method = getattr(backend, "security", None)
    return method() if callable(method) else None


def posture_lines(conf: Any, settings: Any, lock: Any = None) -> list[str]:
    """What `check` says of the security it found: per URL TLS, auth and loopback; the key
    secret's strength (never a secret). `lock`: the lock backend's `security()`."""
    extra = {"broker_url": str(conf.broker_url or "") or None,
             "result_backend": str(conf.result_backend or "") or None}  # fmt: skip
    known = set(settings.server_urls().values())
    urls = {**settings.server_urls(), **{k: v for k, v in extra.items() if v not in known}}
    lines = [broker_tls.corrected(p, conf).line()
             for p in security.postures_with(urls, f"{ENV_PREFIX}LOCK_URL", lock)]
    strength = security.key_secret_strength(settings.key_secret.get_secret_value())
    lines.append(f"{ENV_PREFIX}KEY_SECRET: {strength}")
    allowed = ",".join(settings.allow_insecure) or "nothing"
    lines.append(f"{security.ALLOW_VARIABLE}: {allowed}")
    return lines


def singleton_ttls(tasks: Iterable[Any]) -> Iterator[tuple[str, float]]:
    """(name, lease TTL) of each jobfence task that asks for a TTL of its own."""
    for task in tasks:
        if isinstance(task, SingletonTask) and task.jobfence_ttl:
            yield task.name, float(task.jobfence_ttl)


def check_timeouts(conf: Any, runtime: Runtime, tasks: Iterable[Any] = ()) -> Iterator[Finding]:
    """Lease TTLs below the visibility timeout; the longest countdown below it too."""
    settings = runtime.settings
    options = dict(conf.broker_transport_options or {})
    if "visibility_timeout" not in options:
        return
    vt = float(options["visibility_timeout"])
    if vt < settings.visibility_timeout:  # an app's own value, kept by jobfence.setup
        yield _warn(
            "broker_transport_options.visibility_timeout",
            f"the app's {vt:g}s is shorter than {ENV_PREFIX}VISIBILITY_TIMEOUT "
            f"({settings.visibility_timeout:g}s), by which jobfence sizes the countdown of a "
            "deferred delivery: the broker may deliver it again while it waits",
            f"set {ENV_PREFIX}VISIBILITY_TIMEOUT={vt:g}",
        )
    yield from _lease_ttls_below(vt, runtime, tasks)
    if settings.max_countdown and vt <= settings.max_countdown:
        yield _refuse(
            "broker_transport_options.visibility_timeout",
            f"{vt:g}s is not longer than the longest countdown ({settings.max_countdown:g}s): "
            "the broker redelivers every such job while it waits",
            f"leave the visibility timeout to {ENV_PREFIX}VISIBILITY_TIMEOUT",
        )


def _lease_ttls_below(vt: float, runtime: Runtime, tasks: Iterable[Any]) -> Iterator[Finding]:
    """Refuse the default lease TTL and each task's that is not shorter than the visibility
    timeout `vt`, as the lock server grants them."""
    why = (
        "a crashed worker's message comes back after the visibility timeout and must find "
        "the dead holder's lease expired by then"
    )
    granted = getattr(runtime.backend, "granted_ttl", None)  # etcd: whole seconds, >= 2

    def shown(ttl: float) -> tuple[float, str]:
        real = float(granted(ttl)) if callable(granted) else ttl
        return real, (f"{real:g}s (asked {ttl:g}s; the lock server grants whole seconds)"
                      if real != ttl else f"{ttl:g}s")  # fmt: skip

    ttl, text = shown(runtime.settings.default_ttl)
    if ttl >= vt:
        yield _refuse(
            f"{ENV_PREFIX}DEFAULT_TTL",
            f"the lease TTL {text} is not shorter than the broker's visibility timeout "
            f"{vt:g}s: {why}",
            f"lower {ENV_PREFIX}DEFAULT_TTL or raise {ENV_PREFIX}VISIBILITY_TIMEOUT",
        )
    for name, task_ttl in singleton_ttls(tasks):
        ttl, text = shown(task_ttl)
        if ttl >= vt:
            yield _refuse(
                f"task {name} ttl",
                f"its lease TTL {text} is not shorter than the visibility timeout {vt:g}s: {why}",
                f"lower the task's ttl= or raise {ENV_PREFIX}VISIBILITY_TIMEOUT",
            )


def check_semaphores(runtime: Runtime, tasks: Iterable[Any] = ()) -> Iterator[Finding]:
    """Refuse tasks with `concurrency=` on a lock backend that keeps no semaphores."""
    backend = runtime.backend
    if backend.capabilities.semaphore:
        return
    for task in tasks:
        if isinstance(task, SingletonTask) and task.concurrency:
            yield _refuse(
                f"task {task.name} concurrency",
                f"the {backend.name} lock backend keeps no semaphores, so "
                f"concurrency={task.concurrency} cannot be enforced",
                f"use a lock backend that keeps them ({backends_with('semaphore')}) or drop "
                "concurrency= from the task",
            )


def check_rate_limits(runtime: Runtime, tasks: Iterable[Any] = ()) -> Iterator[Finding]:
    """A task with global_rate_limit needs a lock backend that keeps shared rate limits."""
    backend = runtime.backend
    if backend.capabilities.rate_limit:
        return
    for task in tasks:
        if isinstance(task, SingletonTask) and task.global_rate_limit is not None:
            yield _refuse(
                f"task {task.name} global_rate_limit",
                f"the {backend.name} lock backend keeps no shared rate limits",
                f"use {backends_with('rate_limit')} for {ENV_PREFIX}LOCK_URL, or drop "
                "global_rate_limit",
            )


def check_delivery(conf: Any) -> Iterator[Finding]:
    if not conf.task_acks_late:
        yield _warn(
            "task_acks_late",
            "is off: a message is acked before its task runs, so a crashed worker loses it",
            "leave task_acks_late=True (jobfence gates redeliveries)",
        )
    if not conf.task_reject_on_worker_lost:
        yield _warn(
            "task_reject_on_worker_lost",
            "is off: a job whose pool process died is acked as failed instead of redelivered",
            "leave task_reject_on_worker_lost=True",
        )


def check_environment(environ: Mapping[str, str] | None = None) -> Iterator[Finding]:
    """Warn about JOBFENCE_* names jobfence never reads, in the environment (or `.env`) and
    in Django settings: a typo leaves a default in force."""
    found = [(name, close) for name, close in unknown_variables(environ)]
    if environ is None:
        found += [(f"{name} (in Django settings)", close)
                  for name, close in unknown_django_settings()]  # fmt: skip
    for name, close in found:
        yield Finding(
            False,
            name,
            "is not a jobfence setting, so it is ignored",
            f"did you mean {close}?" if close else SETTINGS_FIX,
            code=UNKNOWN_NAME,
        )


