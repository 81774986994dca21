"""Start-up checks that refuse unsafe settings when a worker or beat starts (DESIGN §6).

This module runs them (`run_checks`, `enforce`, on the worker's and beat's start signals) and
watches a lock server that was down at start; the checks themselves live in `settings_checks`
(judged from the settings and tasks alone) and `server_checks` (they talk to a server)."""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any

from jobfence.config import UnsafeSettings
from jobfence.config.errors import EX_CONFIG
from jobfence.config.findings import LOCK_SERVER_DOWN as LOCK_SERVER_DOWN
from jobfence.config.findings import Finding as Finding
from jobfence.config.urls import redact
from jobfence.locks.backends.redis.checks import CREDENTIALS_FIX as CREDENTIALS_FIX
from jobfence.locks.backends.redis.checks import check_eviction as check_eviction
from jobfence.locks.backends.redis.checks import credentials_refused as credentials_refused
from jobfence.tasks import Runtime
from jobfence.worker.server_checks import REDIS_SCHEMES as REDIS_SCHEMES
from jobfence.worker.server_checks import SECRET_ID_KEY as SECRET_ID_KEY
from jobfence.worker.server_checks import SECRET_ID_RETENTION as SECRET_ID_RETENTION
from jobfence.worker.server_checks import check_broker as check_broker
from jobfence.worker.server_checks import check_key_secret as check_key_secret
from jobfence.worker.server_checks import check_lock_backend as check_lock_backend
from jobfence.worker.server_checks import lock_target as lock_target
from jobfence.worker.settings_checks import DJANGO_CARRIER as DJANGO_CARRIER
from jobfence.worker.settings_checks import JSON_TYPES as JSON_TYPES
from jobfence.worker.settings_checks import SIGNED_TYPES as SIGNED_TYPES
from jobfence.worker.settings_checks import UNKNOWN_NAME as UNKNOWN_NAME
from jobfence.worker.settings_checks import check_delivery as check_delivery
from jobfence.worker.settings_checks import check_environment as check_environment
from jobfence.worker.settings_checks import check_rate_limits as check_rate_limits
from jobfence.worker.settings_checks import check_security as check_security
from jobfence.worker.settings_checks import check_semaphores as check_semaphores
from jobfence.worker.settings_checks import check_serializers as check_serializers
from jobfence.worker.settings_checks import check_signed_carrier as check_signed_carrier
from jobfence.worker.settings_checks import check_timeouts as check_timeouts
from jobfence.worker.settings_checks import lock_security as lock_security
from jobfence.worker.settings_checks import posture_lines as posture_lines

log = logging.getLogger(__name__)

#: Longest pause between two probes of a lock server that was down at start-up.
LOCK_PROBE_CAP = 30.0


class StartupWarning(UserWarning):
    """A start-up check could not verify something, or found a risky but legal setting."""


class StartupRefused(UnsafeSettings):
    """Start-up found settings that break the safety argument; lists every refusal."""

    def __init__(self, findings: list[Finding]) -> None:
        first = findings[0]
        super().__init__(first.setting, first.problem, first.fix)
        self.findings = findings
        self.args = ("\n".join(f"  - {f}" for f in findings),)



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
