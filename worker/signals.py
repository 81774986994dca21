"""Celery signal wiring: start the lease keeper in each pool process, close the runtime at exit."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import signals

from jobfence.tasks import Runtime

log = logging.getLogger(__name__)

RECEIVERS_ATTRIBUTE = "jobfence_signal_receivers"


def keep_alive(app: Any, *receivers: Callable[..., Any]) -> None:
    """Tie receivers to the app's lifetime: Celery holds them weakly, the app strongly."""
    held: list[Callable[..., Any]] = getattr(app, RECEIVERS_ATTRIBUTE, [])
    held.extend(receivers)
    setattr(app, RECEIVERS_ATTRIBUTE, held)


def connect(app: Any, runtime: Runtime) -> None:
    """Wire `runtime` into the worker's life cycle for `app`."""

    def on_process_init(**_: Any) -> None:
        # A forked pool child inherits no keeper thread (it resets after fork): start one.
        runtime.keeper.start()

    def on_process_shutdown(**_: Any) -> None:
        runtime.close()

    def on_worker_shutdown(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            runtime.close()

    keep_alive(app, on_process_init, on_process_shutdown, on_worker_shutdown)
    signals.worker_process_init.connect(on_process_init, weak=True)
    signals.worker_process_shutdown.connect(on_process_shutdown, weak=True)
    signals.worker_shutdown.connect(on_worker_shutdown, weak=True)
