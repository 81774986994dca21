"""Start-up checks that refuse unsafe settings when a worker or beat starts (DESIGN §6)."""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from jobfence.config import UnsafeSettings, security
from jobfence.config.errors import EX_CONFIG, SETTINGS_FIX
from jobfence.config.findings import LOCK_SERVER_DOWN as LOCK_SERVER_DOWN
from jobfence.config.findings import Finding as Finding
from jobfence.config.findings import LockTarget
from jobfence.config.findings import refuse as _refuse
from jobfence.config.findings import warn as _warn
from jobfence.config.schemes import UNIX_SCHEME, backend_schemes
from jobfence.config.settings import ENV_PREFIX, unknown_django_settings, unknown_variables
from jobfence.config.urls import check_url, redact, redlock_masters
from jobfence.locks import BackendUnavailable, registry
from jobfence.locks.backends.redis.checks import CREDENTIALS_FIX as CREDENTIALS_FIX
from jobfence.locks.backends.redis.checks import check_eviction as check_eviction
from jobfence.locks.backends.redis.checks import credentials_refused as credentials_refused
from jobfence.locks.backends.redis.url import tls_hint
from jobfence.locks.registry import backends_with
from jobfence.tasks import Runtime, SingletonTask
from jobfence.tasks.keys import secret_id
from jobfence.worker import broker_tls

log = logging.getLogger(__name__)

#: Longest pause between two probes of a lock server that was down at start-up.
LOCK_PROBE_CAP = 30.0
UNKNOWN_NAME = "unknown-name"  # a JOBFENCE_* name jobfence never reads (a typo, usually)
#: Where the lock server keeps the key secret's id (no job key: those hold a ':').
SECRET_ID_KEY = "key-secret-id"
#: It must outlive every DONE record under the secret; it is refreshed at each start.
SECRET_ID_RETENTION = 10 * 365 * 24 * 3600.0
JSON_TYPES = ("json", "application/json")
#: Celery's message signing: JSON inside, signed with the app's key (app.setup_security()).
SIGNED_TYPES = ("auth", "application/data")
REDIS_SCHEMES = registry.entry("redis").schemes
#: The carrier of Django tasks (tasks.django_tasks.CARRIER; named here, Django is optional).
DJANGO_CARRIER = "jobfence.django_task"


class StartupWarning(UserWarning):
    """A start-up check could not verify something, or found a risky but legal setting."""


class StartupRefused(UnsafeSettings):
    """Start-up found settings that break the safety argument; lists every refusal."""

    def __init__(self, findings: list[Finding]) -> None:
        first = findings[0]
        super().__init__(first.setting, first.problem, first.fix)
        self.findings = findings
        self.args = ("\n".join(f"  - {f}" for f in findings),)



# --------------------------------------------------------------------------- the checks


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


def check_lock_backend(
    conf: Any, runtime: Runtime, tasks: Iterable[Any] = ()
) -> Iterator[Finding]:
    """A lock server a fleet can share, and what its backend's own start-up checks find
    (`LockBackend.startup_findings`, in each backend's module)."""
    target = lock_target(runtime, tasks)
    entry = _entry(target.url)
    if entry is not None and not entry.fleet and not conf.task_always_eager:
        yield _refuse(
            target.setting,
            f"{entry.schemes[0]}:// locks live in one process; worker processes would not "
            "see each other's locks",
            "point it at a Redis server, e.g. redis://127.0.0.1:6379/0",
        )
        return
    yield from runtime.backend.startup_findings(target)


def lock_target(runtime: Runtime, tasks: Iterable[Any] = ()) -> LockTarget:
    """What the lock backend's start-up checks are told: its URL's variable and value, the
    socket timeout, and every lease TTL the app asks for (the default and each task's)."""
    settings = runtime.settings
    ttls = (settings.default_ttl, *(ttl for _, ttl in _singleton_ttls(tasks)))
    return LockTarget(f"{ENV_PREFIX}LOCK_URL", settings.lock_url, settings.socket_timeout, ttls)


def _entry(url: str) -> registry.BackendEntry | None:
    try:
        return registry.entry_for(url)
    except ValueError:
        return None


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


def lock_server_down(findings: Iterable[Finding]) -> bool:
    """True if the findings say the lock server did not answer at start-up."""
    return any(f.code == LOCK_SERVER_DOWN for f in findings)


def watch_lock_server(runtime: Runtime, *, cap: float = LOCK_PROBE_CAP) -> threading.Thread | None:
    """Probe a lock server that was down at start-up until it answers, then check it.

    Logs one line when it answers, and an ERROR naming the fix for each refusal it then
    finds (the worker cannot be refused any more by then). Runs in a daemon thread, on the
    backend's `outage_probe` (a client of its own); None where the backend gives none.
    """
    target = lock_target(runtime)
    prober = runtime.backend.outage_probe(target)
    if prober is None:
        return None

    def probe() -> None:
        delay = min(0.5, cap)
        try:
            while not prober.answers():
                time.sleep(delay)
                delay = min(cap, delay * 2)
            log.warning("jobfence: the lock server at %s answers again; jobs proceed",
                        redact(target.url))
            for finding in prober.findings():
                (log.error if finding.refuse else log.warning)("jobfence: %s", finding)
        except Exception:  # a probe must never take the worker down
            log.exception("jobfence: lock-server probe failed")
        finally:
            prober.close()

    thread = threading.Thread(target=probe, name="jobfence-lock-probe", daemon=True)
    thread.start()
    return thread


def _same_server(a: str, b: str) -> bool:
    """Whether Redis URL `a` names the server (or a Redlock master) of lock URL `b`."""
    if urlsplit(b).scheme in backend_schemes("redlock").schemes:  # each master, as a lock server
        return any(_same_server(a, master) for master in redlock_masters(b))
    pa, pb = urlsplit(a), urlsplit(b)
    if pb.scheme not in REDIS_SCHEMES:  # a database, etcd, ZooKeeper: never the Redis broker
        return False
    if UNIX_SCHEME in (pa.scheme, pb.scheme):
        return pa.path == pb.path
    return (pa.hostname, pa.port or 6379) == (pb.hostname, pb.port or 6379)


def check_broker(conf: Any, runtime: Runtime) -> Iterator[Finding]:
    """A Redis broker that evicts loses messages: refuse it (skipped if it is the lock server)."""
    url = str(conf.broker_url or "")
    if urlsplit(url).scheme not in REDIS_SCHEMES:
        return
    try:  # the app's own broker_url need not have passed Settings' checks
        check_url(url, variable="broker_url", schemes=None, what="broker URL",
                  example="redis://127.0.0.1:6379/1")
    except UnsafeSettings as bad:
        yield _refuse(bad.field, bad.problem, bad.fix)
        return
    if _same_server(url, runtime.settings.lock_url):
        return
    timeout = runtime.settings.socket_timeout
    # A user's own app (jobfence.setup) sets its broker itself, not through JOBFENCE_*.
    setting = f"{ENV_PREFIX}BROKER_URL" if url == runtime.settings.broker_url else "broker_url"
    try:  # a CA or certificate file the URL names must be readable: not an outage later
        broker_tls.use_ssl(url, setting)
    except UnsafeSettings as bad:
        yield _refuse(bad.field, bad.problem, bad.fix)
        return
    tls = broker_tls.broker_client_tls(conf)
    options: dict[str, Any] = {}
    if tls is not None:
        if tls.unverified() and not _allowed(conf, runtime):
            return  # refused by the security check: no password over an unverified channel
        # The TLS kombu will use (broker_use_ssl, the URL's ssl_ options), not redis-py's own.
        options = {} if tls.plain else dict(tls.options)
    client = redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0), **options,
    )
    try:
        try:
            client.ping()
        except RedisError as exc:
            wrong = credentials_refused(exc)
            if wrong:
                yield _refuse(setting, f"the broker at {redact(url)} {wrong}", CREDENTIALS_FIX)
                return
            hint = tls_hint(exc)
            if hint:  # a certificate that does not verify is no outage: never start with it
                yield _refuse(setting, f"the broker at {redact(url)} cannot be used ({exc})",
                              hint.replace("the lock server", "the broker"))
                return
            yield _warn(
                setting,
                f"cannot reach the broker at {redact(url)} yet ({exc}); its eviction policy "
                "is unchecked",
                "make sure the broker runs with maxmemory-policy noeviction",
            )
            return
        yield from check_eviction(client, "broker", setting, url)
    finally:
        client.close()


def _allowed(conf: Any, runtime: Runtime) -> bool:
    """Whether JOBFENCE_ALLOW_INSECURE allows every broker TLS downgrade of `conf`."""
    allowed = set(runtime.settings.allow_insecure)
    return all(d.item in allowed for d in broker_tls.downgrades(conf, runtime.settings))


def _singleton_ttls(tasks: Iterable[Any]) -> Iterator[tuple[str, float]]:
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
    why = (
        "a crashed worker's message comes back after the visibility timeout and must find "
        "the dead holder's lease expired by then"
    )
    granted = getattr(runtime.backend, "granted_ttl", None)  # etcd: whole seconds, >= 2

    def shown(ttl: float) -> tuple[float, str]:
        real = float(granted(ttl)) if callable(granted) else ttl
        return real, (f"{real:g}s (asked {ttl:g}s; the lock server grants whole seconds)"
                      if real != ttl else f"{ttl:g}s")  # fmt: skip

    ttl, text = shown(settings.default_ttl)
    if ttl >= vt:
        yield _refuse(
            f"{ENV_PREFIX}DEFAULT_TTL",
            f"the lease TTL {text} is not shorter than the broker's visibility timeout "
            f"{vt:g}s: {why}",
            f"lower {ENV_PREFIX}DEFAULT_TTL or raise {ENV_PREFIX}VISIBILITY_TIMEOUT",
        )
    for name, task_ttl in _singleton_ttls(tasks):
        ttl, text = shown(task_ttl)
        if ttl >= vt:
            yield _refuse(
                f"task {name} ttl",
                f"its lease TTL {text} is not shorter than the visibility timeout {vt:g}s: {why}",
                f"lower the task's ttl= or raise {ENV_PREFIX}VISIBILITY_TIMEOUT",
            )
    if settings.max_countdown and vt <= settings.max_countdown:
        yield _refuse(
            "broker_transport_options.visibility_timeout",
            f"{vt:g}s is not longer than the longest countdown ({settings.max_countdown:g}s): "
            "the broker redelivers every such job while it waits",
            f"leave the visibility timeout to {ENV_PREFIX}VISIBILITY_TIMEOUT",
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


def check_key_secret(runtime: Runtime) -> Iterator[Finding]:
    """Refuse a key secret that would silently re-run finished jobs (how-to: rotate-key-secret).

    The lock server keeps the id of the secret in use (`secret_id`, never the secret). A
    secret whose id is neither that one nor one of JOBFENCE_KEY_SECRET_PREVIOUS's would look
    for every DONE record and held lock under new names; JOBFENCE_KEY_SECRET_RESET allows it.
    """
    backend, settings = runtime.backend, runtime.settings
    mine = secret_id(runtime.secret)
    try:
        stored = backend.swap_publish(SECRET_ID_KEY, mine, mine, SECRET_ID_RETENTION)
        if stored is None:  # first start, or the same secret: kept and refreshed
            return
        known = {secret_id(old) for old in runtime.previous_secrets}
        if stored in known or settings.key_secret_reset:
            if stored not in known:
                log.warning(
                    "jobfence: JOBFENCE_KEY_SECRET_RESET: a new key secret replaces "
                    "id %s; jobs finished under the old one may run again",
                    stored,
                )
            backend.swap_publish(SECRET_ID_KEY, stored, mine, SECRET_ID_RETENTION)
            return
    except BackendUnavailable:
        return  # the lock backend's own check reports the lock server down; nothing to compare with
    p = ENV_PREFIX
    yield _refuse(
        f"{p}KEY_SECRET",
        f"is not the key secret the lock server's job records and locks were written under "
        f"(stored id {stored}, this one {mine}): every finished job would run again",
        f"to rotate, keep the old secret in {p}KEY_SECRET_PREVIOUS while the new one rolls out "
        f"(docs/how-to/rotate-key-secret.md); to start afresh on purpose, set "
        f"{p}KEY_SECRET_RESET=true for one start",
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


#: What each start-up check judges, in the order they run: `check` lists them. The ones
#: marked True talk to a server (the lock server, a Redis broker).
CHECKED: tuple[tuple[str, str, bool], ...] = (
    ("serialisers", "JSON (or signed JSON) only: accept_content, task/result/event serializer",
     False),
    ("security", "TLS, authentication and the key secret's strength, per server URL", False),
    ("delivery", "task_acks_late and task_reject_on_worker_lost", False),
    ("timeouts", "every lease TTL below the broker's visibility timeout, and the longest "
     "countdown below it", False),
    ("semaphores", "tasks with concurrency= on a lock backend that keeps semaphores", False),
    ("rate limits", "tasks with global_rate_limit= on a lock backend that keeps them", False),
    ("names", "JOBFENCE_* names in the environment, .env and Django settings that jobfence "
     "never reads (typos)", False),
    ("lock server", "it answers as the server its URL names, with credentials that work, "
     "and cannot evict keys", True),
    ("key secret", "the secret the lock server's records were written under", True),
    ("broker", "a Redis broker cannot evict messages", True),
)  # fmt: skip


def run_checks(app: Any, runtime: Runtime, *, servers: bool = True) -> list[Finding]:
    """Every finding for `app`; with `servers` (a worker's start, `check`) also those that
    talk to the lock server and a Redis broker (CHECKED says which)."""
    conf = app.conf
    tasks = list(app.tasks.values())
    findings = [
        *check_serializers(conf),
        *check_signed_carrier(conf, tasks),
        *check_security(conf, runtime),
        *check_delivery(conf),
        *check_timeouts(conf, runtime, tasks),
        *check_semaphores(runtime, tasks),
        *check_rate_limits(runtime, tasks),
        *check_environment(),
    ]
    if servers:
        findings += [
            *check_lock_backend(conf, runtime, tasks),
            *check_key_secret(runtime),
            *check_broker(conf, runtime),
        ]
    return findings


def enforce(app: Any, runtime: Runtime) -> list[Finding]:
    """Warn about soft findings; raise StartupRefused if any finding refuses."""
    findings = run_checks(app, runtime)
    for finding in findings:
        if not finding.refuse:
            log.warning("jobfence start-up: %s", finding)
            warnings.warn(str(finding), StartupWarning, stacklevel=2)
    refusals = [f for f in findings if f.refuse]
    if refusals:
        raise StartupRefused(refusals)
    return findings


def refusal_text(exc: BaseException) -> str:
    """The lines a refused start shows (the worker, beat, `check`, `manage.py check`)."""
    if isinstance(exc, StartupRefused):
        return str(exc)
    return "\n".join(f"  - {line.strip().removeprefix('also ')}" for line in str(exc).splitlines())


def enforce_or_exit(app: Any, runtime: Runtime, what: str) -> None:
    """`enforce`, turning a refusal into a clear message on stderr and exit status 78.

    `runtime` may be the stand-in `jobfence.setup` returns when the settings could not be
    read at import (worker/setup.py): reading them again here raises the same error."""
    try:
        findings = enforce(app, runtime)
    except (UnsafeSettings, ImportError) as exc:  # StartupRefused; or unusable settings
        print(
            f"jobfence: refusing to start the {what}: unsafe settings\n{refusal_text(exc)}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EX_CONFIG) from None
    if lock_server_down(findings):
        watch_lock_server(runtime)


def connect(app: Any, runtime: Runtime) -> None:
    """Run the checks when a worker (celeryd_init) or beat (beat_init) of `app` starts."""
    from celery import signals

    from jobfence.worker.signals import keep_alive

    def on_worker_init(sender: Any = None, instance: Any = None, **_: Any) -> None:
        if getattr(instance, "app", None) is app:
            enforce_or_exit(app, runtime, "worker")

    def on_beat_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            enforce_or_exit(app, runtime, "beat")

    keep_alive(app, on_worker_init, on_beat_init)
    signals.celeryd_init.connect(on_worker_init, weak=True)
    signals.beat_init.connect(on_beat_init, weak=True)
