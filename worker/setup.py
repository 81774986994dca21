"""`jobfence.setup(app)`: give your own Celery app everything an app of `create_app` has.

That is: the safe Celery configuration (DESIGN §5), the start-up checks that refuse unsafe
settings when a worker or beat starts (exit 78, every problem listed), the signals that run
the lease keeper in each pool process and close the runtime at exit, the /metrics
endpoint (JOBFENCE_METRICS_PORT), the custody of each worker's Redis-broker deliveries (a
killed worker's jobs come back about one lease TTL, their task's own, after its last
record: worker/custody.py), and beat's leader election. The broker and the result backend
stay the app's own.

A value the app sets itself is never overridden: setup fills in only what the app leaves
unset, merges its broker transport options under the app's, and lists what it kept in a
warning. The start-up checks then judge the app's values: an unsafe one (pickle, a lease
TTL not below the visibility timeout, ...) refuses the worker rather than being replaced
behind the user's back.

It lives in `worker` because it wires the checks and signals, which are Celery-process
concerns; `tasks` (the decorator and its lazily built runtime) must not import `worker`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any, cast

from jobfence.config import Settings, UnsafeSettings, load_settings
from jobfence.locks.registry import MissingExtra
from jobfence.tasks.runtime import Runtime, install, installed, runtime_for
from jobfence.worker import broker_tls, checks, custody, metrics_server, outbox_relay, signals

log = logging.getLogger(__name__)

BEAT_SCHEDULER = "jobfence.worker.beat:LeaderScheduler"
JSON_ONLY = ["json"]
SETUP_ATTRIBUTE = "jobfence_setup"  # the SafeConfig applied to an app, once set up
UNSETTLED_ATTRIBUTE = "jobfence_unsettled"  # why setup could not read the settings
TRANSPORT_OPTIONS = "broker_transport_options"


def transport_options(settings: Settings) -> dict[str, Any]:
    """Visibility timeout, and kombu's unacked-restore sweep tuned so redelivery really happens.

    kombu's Redis transport sweeps for expired unacked messages only every
    `unacked_restore_interval * unacked_restore_throttle` seconds (10 x 10 by default), and a
    worker killed mid-sweep holds the sweep mutex for `unacked_mutex_expire` (300 s).
    """
    vt = settings.visibility_timeout
    return {
        "visibility_timeout": vt,
        "unacked_restore_interval": min(10.0, max(0.5, vt / 20)),
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": min(300.0, max(5.0, vt / 4)),
    }


def safe_config(settings: Settings) -> dict[str, Any]:
    """The Celery settings every jobfence app runs with (DESIGN §5); no broker, no backend."""
    return {
        TRANSPORT_OPTIONS: transport_options(settings),
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": JSON_ONLY,
        "result_accept_content": JSON_ONLY,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "beat_scheduler": BEAT_SCHEDULER,
    }


def _same(a: Any, b: Any) -> bool:
    """Equal, counting ["json"], ("json",) and {"json"} as one value."""
    if isinstance(a, list | tuple | set | frozenset) and isinstance(b, list | tuple | set):
        return sorted(map(str, a)) == sorted(map(str, b))
    return bool(a == b)


class SafeConfig:
    """Fills the safe values into an app's configuration each time Celery (re)loads it."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.values = dict(values)
        self.kept: dict[str, Any] = {}  # the app's own values that differ from ours

    def apply(self, conf: Any) -> dict[str, Any]:
        """Set every value `conf` leaves unset; return the app's differing values (kept)."""
        kept: dict[str, Any] = {}
        for key, ours in self.values.items():
            if key == TRANSPORT_OPTIONS:
                theirs = dict(conf.get(TRANSPORT_OPTIONS) or {})
                conf[TRANSPORT_OPTIONS] = {**ours, **theirs}
                kept.update({
                    f"{TRANSPORT_OPTIONS}[{k!r}]": theirs[k]
                    for k in ours if k in theirs and not _same(theirs[k], ours[k])
                })  # fmt: skip
            elif not conf.value_set_for(key):
                conf[key] = ours
            elif not _same(conf[key], ours):
                kept[key] = conf[key]
        # A rediss:// broker or result backend gets verified TLS unless the app set its own
        # (kombu's Redis transport otherwise checks no certificate): worker/broker_tls.py.
        broker_tls.fill(conf)
        self.kept = kept
        if kept:
            log.warning(
                "jobfence.setup kept the app's own values for %s (start-up checks judge them; "
                "unsafe ones refuse the worker)",
                ", ".join(f"{k}={v!r}" for k, v in kept.items()),
            )
        return kept

    def on_after_configure(self, sender: Any = None, source: Any = None, **_: Any) -> None:
        if source is not None:
            self.apply(source)


def setup(app: Any, settings: Settings | None = None) -> Runtime:
    """Make `app` (your own Celery app) a jobfence app; returns its runtime.

    `settings` defaults to JOBFENCE_* from the environment, read now (an unusable value
    raises UnsafeSettings naming the variable). Nothing here talks to a server. Calling it
    again for the same app returns the same runtime; settings for an app already set up
    raise ValueError.
    """
    done: SafeConfig | None = getattr(app, SETUP_ATTRIBUTE, None)
    runtime = installed(app)
    if done is not None and runtime is not None:
        if settings is not None and settings != runtime.settings:
            raise ValueError(
                f"Celery app {getattr(app, 'main', app)!r} is already set up with other "
                "settings; call jobfence.setup(app, settings) once, where the app is built"
            )
        return runtime
    if settings is not None or runtime is None:
        try:
            runtime = install(app, settings if settings is not None else load_settings())
        except (UnsafeSettings, MissingExtra) as exc:
            if settings is not None:
                raise
            return _set_up_unsettled(app, exc)
    _wire(app, runtime, SafeConfig(safe_config(runtime.settings)))
    return runtime


def _wire(app: Any, runtime: Runtime, config: SafeConfig) -> None:
    setattr(app, SETUP_ATTRIBUTE, config)
    # Celery reads its configuration lazily (config_from_object, Django settings): fill in
    # whenever it is (re)loaded, and now if it already was.
    app.on_after_configure.connect(config.on_after_configure, weak=False)
    if app.configured:
        config.apply(app.conf)
    signals.connect(app, runtime)
    checks.connect(app, runtime)
    metrics_server.connect(app, runtime)  # /metrics when JOBFENCE_METRICS_PORT is set
    custody.connect(app)  # a killed worker's jobs back in ~1 task TTL on the Redis broker
    outbox_relay.connect(app)  # JOBFENCE_OUTBOX_URL: sends committed, unsent messages
    _register_django_check(app)


def _register_django_check(app: Any) -> None:
    if "django.conf" in sys.modules:  # a Django project: `manage.py check` runs them too
        from jobfence.worker import django_check

        django_check.register(app)


class UnsettledRuntime:
    """What `setup` returns when JOBFENCE_* could not be read where the app is built.

    An import must not fail for it: a Django project imports its Celery app in every
    `manage.py` command, `migrate` included. Every use reads the settings again (and so
    raises the same error, naming the variable and the fix); a worker or beat of the app
    refuses to start with it (exit 78); `manage.py check` and `jobfence check` report it.
    """

    def __init__(self, app: Any, error: Exception) -> None:
        self.app = app
        self.error = error

    def __getattr__(self, name: str) -> Any:
        return getattr(runtime_for(self.app), name)


def _set_up_unsettled(app: Any, error: Exception) -> Runtime:
    """The safe Celery configuration (from the defaults) and the start-up refusal, without
    a runtime: nothing raises now, and nothing runs with these settings later."""
    stand_in = UnsettledRuntime(app, error)
    config = SafeConfig(safe_config(Settings.model_construct()))
    setattr(app, SETUP_ATTRIBUTE, config)
    setattr(app, UNSETTLED_ATTRIBUTE, error)
    app.on_after_configure.connect(config.on_after_configure, weak=False)
    if app.configured:
        config.apply(app.conf)
    checks.connect(app, cast(Runtime, stand_in))  # reads them again at start: refused
    _register_django_check(app)
    return cast(Runtime, stand_in)


def unsettled(app: Any) -> Exception | None:
    """Why `setup` could not read the settings of `app` (it then refuses its workers)."""
    error = getattr(app, UNSETTLED_ATTRIBUTE, None)
    return error if isinstance(error, Exception) and installed(app) is None else None


def is_set_up(app: Any) -> bool:
    """Whether `setup` (or `create_app`) configured `app`."""
    return isinstance(getattr(app, SETUP_ATTRIBUTE, None), SafeConfig)
