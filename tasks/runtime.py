"""The per-process runtime behind @singleton_task: backend, keeper, executor and metrics.

An app gets its runtime from `install(app, settings)` (or `jobfence.setup`), or else on
first use: `runtime_for(app)` builds it from the JOBFENCE_* environment, once per app and
process, so `@singleton_task` works with no other call. Nothing is built at import time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jobfence.config.settings import Settings, load_settings, refuse_insecure
from jobfence.locks.acquire import Backoff
from jobfence.locks.api import open_backend
from jobfence.locks.backend import LockBackend
from jobfence.locks.decisions import DecisionBounds
from jobfence.locks.keeper import LeaseKeeper
from jobfence.locks.lease import Lease
from jobfence.tasks.decisions import DecisionRecorder
from jobfence.tasks.errors import NotInstalled
from jobfence.tasks.executor import Executor, Redelivery
from jobfence.tasks.metrics import Metrics
from jobfence.tasks.middleware import standard
from jobfence.tasks.tracing import job_tracer

if TYPE_CHECKING:
    from jobfence.tasks.effects import SqlEffects

log = logging.getLogger(__name__)
APP_ATTRIBUTE = "jobfence_runtime"


class Runtime:
    """Built once per app from Settings; forked children reuse it (the keeper restarts)."""

    def __init__(
        self,
        settings: Settings,
        *,
        backend: LockBackend | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.secret = settings.secret_bytes()  # the key HMAC's secret, read once
        # Earlier secrets during a rotation: job keys under them are looked up, never granted.
        self.previous_secrets = settings.previous_secret_bytes()
        self.metrics = metrics or Metrics()
        if backend is None:  # judged before any connection: no password over a refused channel
            refuse_insecure(settings)
        self.backend = backend or open_backend(
            settings.lock_url,
            prefix=settings.key_prefix,
            socket_timeout=settings.socket_timeout,
            fence_retention=settings.fence_retention,
        )
        self.keeper = LeaseKeeper(
            fraction=settings.heartbeat_fraction,
            on_lost=self._on_lost,
            on_extend=self.metrics.observe_heartbeat,
        )
        self.executor = _executor(settings, self.backend, self.keeper, self.metrics)
        self._effects: SqlEffects | None = None

    @property
    def effects(self) -> SqlEffects:
        """The ledger database (JOBFENCE_DATABASE_URL), built on first use in this process."""
        if self._effects is None:
            url = self.settings.database_url
            if not url:
                raise NotInstalled("JOBFENCE_DATABASE_URL is not set; tasks that write a ledger "
                                   "need it, e.g. sqlite:///ledger.sqlite")
            from jobfence.tasks.effects import SqlEffects, make_engine  # SQLAlchemy: on use

            self._effects = SqlEffects(make_engine(url))
        return self._effects

    def _on_lost(self, lease: Lease, cause: BaseException) -> None:
        self.metrics.lost_leases.inc()
        log.warning(
            "lease lost key=%s fence=%s cause=%s", lease.key, lease.fence, type(cause).__name__
        )

    def close(self) -> None:
        self.executor.close()  # its middleware: outage warnings summed up, decisions stored
        self.keeper.stop()
        self.backend.close()
        if self._effects is not None:
            self._effects.engine.dispose()


def _executor(
    settings: Settings, backend: LockBackend, keeper: LeaseKeeper, metrics: Metrics
) -> Executor:
    """The executor on `backend`, with every observer (metrics, the decision log, tracing)."""
    # Every delivery's decisions: logged, and kept by the lock server where it can.
    recorder = DecisionRecorder(backend.decision_log(DecisionBounds(
        per_key=settings.decision_log_size, total=settings.decision_log_total,
        ttl=settings.decision_log_ttl,
    ))) if settings.decision_log_size else None  # fmt: skip
    return Executor(
        backend,
        keeper,
        backoff=Backoff(settings.backoff_base, settings.backoff_cap),
        metrics=metrics,
        redelivery=Redelivery(limit=settings.redelivery_limit, base=settings.redelivery_delay),
        middleware=standard(metrics, recorder, job_tracer()),  # every observer, here
    )


_build_lock = threading.Lock()


def _new_build_lock() -> None:
    # A thread of the parent may hold the lock at fork; the child has no such thread.
    global _build_lock
    _build_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_build_lock)


#: While a test isolates jobfence (jobfence.testing), every app's runtime comes from here.
_substitute: Callable[[Any], Runtime] | None = None


def substitute(provider: Callable[[Any], Runtime] | None) -> Callable[[Any], Runtime] | None:
    """Make `provider(app)` answer every `runtime_for(app)` (None: stop); returns the one it
    replaced, for the caller to restore. For jobfence.testing: no app's own runtime is touched."""
    global _substitute
    previous, _substitute = _substitute, provider
    return previous


def install(app: Any, settings: Settings | Runtime) -> Runtime:
    """Attach a runtime to a Celery app (replacing any); @singleton_task finds it there."""
    runtime = settings if isinstance(settings, Runtime) else Runtime(settings)
    setattr(app, APP_ATTRIBUTE, runtime)
    return runtime


def installed(app: Any) -> Runtime | None:
    """The app's runtime if one was installed or built already; never builds one."""
    runtime = getattr(app, APP_ATTRIBUTE, None)
    return runtime if isinstance(runtime, Runtime) else None


def runtime_for(app: Any) -> Runtime:
    """The app's runtime; built from JOBFENCE_* on first use if none was installed.

    Built once per app and process (threads racing here get the same one); a forked
    child keeps its parent's (its keeper and connections reset after the fork).
    Raises UnsafeSettings, naming the variable, if the environment is not usable.
    """
    provider = _substitute
    if provider is not None:
        return provider(app)
    runtime = installed(app)
    if runtime is not None:
        return runtime
    with _build_lock:
        runtime = installed(app)
        if runtime is None:
            runtime = install(app, load_settings())
            log.debug("jobfence runtime for app %r built from the environment", _name(app))
    return runtime


def _name(app: Any) -> str:
    return str(getattr(app, "main", None) or type(app).__name__)
