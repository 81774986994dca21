"""The worker's Prometheus /metrics endpoint (JOBFENCE_METRICS_PORT), summed over its pool.

One endpoint per Celery worker, served by a thread of the main process. Under the prefork
pool the tasks run in child processes, so the main process switches prometheus_client to
its multiprocess mode at `worker_init`, before the pool forks: every process then writes its
values to files in a directory of this worker's own (made fresh at each start, removed at
shutdown), and each scrape sums them. A child that exits keeps its counts (its live gauges
are dropped; its counter and histogram files are folded into one archive file so a pool
that recycles children does not slow scrapes down). Single-process pools (threads, solo,
gevent, eventlet) serve the runtime's own registry, with the process's default registry.

Why not one endpoint per pool process: ports would multiply with --concurrency and die with
each recycled child, and Prometheus would have to sum what one worker should report.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import logging
import os
import shutil
import ssl
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from jobfence.config import UnsafeSettings
from jobfence.config.settings import ENV_PREFIX
from jobfence.tasks.runtime import Runtime
from jobfence.worker.metrics_http import REQUEST_TIMEOUT as REQUEST_TIMEOUT
from jobfence.worker.metrics_http import basic_auth as basic_auth
from jobfence.worker.metrics_http import serve as serve

log = logging.getLogger(__name__)

# prometheus_client's multiprocess modules carry no type hints.
_values: Any = importlib.import_module("prometheus_client.values")
_mmap: Any = importlib.import_module("prometheus_client.mmap_dict")
_multiprocess: Any = importlib.import_module("prometheus_client.multiprocess")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
DIR_PREFIX = "jobfence-metrics-"
EXPORTER_ATTRIBUTE = "jobfence_metrics_exporter"
ARCHIVE = "archive"  # the pid part of the files that hold exited processes' counts
_FOLDED = ("counter", "histogram")  # summed over processes: safe to fold into one file


class MetricsPortUnavailable(UnsafeSettings):
    """The /metrics port could not be bound (taken by another worker or program)."""


def _alive(pid: int) -> bool:
    """Whether `pid` may still write its files (a zombie, dead but not yet reaped, may not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc here, or gone meanwhile
        return True


def _pid_of(path: str) -> int | None:
    """The pid in `counter_123.db` or `gauge_livesum_123.db` (None for the archive)."""
    stem = os.path.basename(path)[: -len(".db")]
    tail = stem.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def fresh_directory(base: str | None = None) -> str:
    """A new empty directory for one worker's files; removes those of dead workers first."""
    base = base or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    for old in glob.glob(os.path.join(base, DIR_PREFIX + "*")):
        pid = os.path.basename(old)[len(DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=base)


class PoolCollector:
    """Sums every process's files in `path`; settles the files of processes that exited."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._inner = _multiprocess.MultiProcessCollector(None, path)
        self._lock = threading.Lock()  # scrapes run on threads of their own

    def collect(self) -> Iterator[Any]:
        with self._lock:
            self.settle()
            found = list(self._inner.collect())
        yield from found

    def settle(self) -> None:
        """Forget live gauges of exited processes; fold their counters and histograms."""
        me = os.getpid()
        dead = {
            pid
            for f in glob.glob(os.path.join(self.path, "*.db"))
            if (pid := _pid_of(f)) is not None and pid != me and not _alive(pid)
        }
        for pid in dead:
            _multiprocess.mark_process_dead(pid, self.path)
            for kind in _FOLDED:
                self._fold(os.path.join(self.path, f"{kind}_{pid}.db"), kind)

    def _fold(self, path: str, kind: str) -> None:
        if not os.path.exists(path):
            return
        archive = _mmap.MmapedDict(os.path.join(self.path, f"{kind}_{ARCHIVE}.db"))
        try:
            for key, value, _timestamp, _pos in _mmap.MmapedDict.read_all_values_from_file(path):
                total, _ = archive.read_value(key)
                archive.write_value(key, total + value, 0.0)
        finally:
            archive.close()
        os.remove(path)


class _Both:
    """The runtime's registry and the process's default one, as one collector."""

    def __init__(self, *registries: CollectorRegistry) -> None:
        self.registries = registries

    def collect(self) -> Iterable[Any]:
        for registry in self.registries:
            yield from registry.collect()


class Exporter:
    """A running /metrics endpoint for one runtime (built by `start`)."""

    def __init__(self, runtime: Runtime, *, multiprocess: bool) -> None:
        self.runtime = runtime
        self.multiprocess = multiprocess
        self.path: str | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_port) if self._server is not None else 0

    @classmethod
    def start(cls, runtime: Runtime, *, multiprocess: bool, port: int | None = None) -> Exporter:
        """Bind the port (MetricsPortUnavailable if taken), then serve. Call before forking."""
        settings = runtime.settings
        port = settings.metrics_port if port is None else port
        if port is None:
            raise ValueError(f"{ENV_PREFIX}METRICS_PORT is not set")
        exporter = cls(runtime, multiprocess=multiprocess)
        exporter._serve(port)
        if multiprocess:
            try:
                exporter._go_multiprocess()
            except OSError as exc:
                exporter.stop()
                raise UnsafeSettings(
                    MULTIPROC_ENV,
                    f"cannot make this worker's metrics directory ({exc.strerror or exc})",
                    f"point {MULTIPROC_ENV} (or TMPDIR) at a writable directory",
                ) from None
        else:
            exporter.registry.register(_Both(runtime.metrics.registry, REGISTRY))
        log.info(
            "jobfence metrics on %s://%s:%d/metrics (%s%s)",
            "https" if settings.metrics_certfile else "http", settings.metrics_addr,
            exporter.port, "summed over pool processes" if multiprocess else "one process",
            ", basic auth" if settings.metrics_basic_auth else "",
        )  # fmt: skip
        return exporter

    def _serve(self, port: int) -> None:
        """Bind `port` and serve the registry: UnsafeSettings for a certificate that cannot
        be used, MetricsPortUnavailable for a port that cannot be bound."""
        settings = self.runtime.settings
        auth = settings.metrics_basic_auth
        try:
            self._server, self._thread = serve(
                port, settings.metrics_addr, self.registry,
                credentials=auth.get_secret_value() if auth else None,
                certfile=settings.metrics_certfile, keyfile=settings.metrics_keyfile,
            )  # fmt: skip
        except ssl.SSLError as exc:
            raise UnsafeSettings(
                f"{ENV_PREFIX}METRICS_CERTFILE",
                f"cannot serve /metrics over TLS with it ({exc.reason or exc})",
                f"point {ENV_PREFIX}METRICS_CERTFILE and {ENV_PREFIX}METRICS_KEYFILE at a PEM "
                "certificate and its private key",
            ) from None
        except OSError as exc:
            raise MetricsPortUnavailable(
                f"{ENV_PREFIX}METRICS_PORT",
                f"cannot serve /metrics on {settings.metrics_addr}:{port} ({exc.strerror or exc})",
                "give each worker on a host its own port, or free this one",
            ) from None

    def _go_multiprocess(self) -> None:
        # The user's PROMETHEUS_MULTIPROC_DIR, if any, holds this worker's own directory.
        self.path = fresh_directory(os.environ.get(MULTIPROC_ENV))
        os.environ[MULTIPROC_ENV] = self.path  # read when a value opens its file
        # Values built from now on (in this process and, after the fork, in the children)
        # are file-backed; a fresh class so no file opened before is reused.
        _values.ValueClass = _values.MultiProcessValue()
        self.runtime.metrics.rebuild()
        self.registry.register(PoolCollector(self.path))

    def in_child(self) -> None:
        """In a forked pool process: close the inherited listening socket (the parent serves)."""
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.socket.close()
            self._server = None

    def child_exiting(self) -> None:
        """In a pool process about to exit: its live gauges stop counting."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                _multiprocess.mark_process_dead(os.getpid(), self.path)

    def stop(self) -> None:
        """In the main process at shutdown: stop serving and remove the files."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.path is not None and os.getpid() == _owner(self.path):
            shutil.rmtree(self.path, ignore_errors=True)


def _owner(path: str) -> int | None:
    pid = os.path.basename(path)[len(DIR_PREFIX) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def forks(pool_cls: Any) -> bool:
    """Whether a worker with this pool runs tasks in child processes (prefork)."""
    from celery import concurrency
    from celery.concurrency.prefork import TaskPool

    try:
        cls = concurrency.get_implementation(pool_cls)
    except Exception:  # an unknown pool: Celery itself reports it
        return False
    return isinstance(cls, type) and issubclass(cls, TaskPool)


def exporter_of(app: Any) -> Exporter | None:
    found = getattr(app, EXPORTER_ATTRIBUTE, None)
    return found if isinstance(found, Exporter) else None


def connect(app: Any, runtime: Runtime) -> None:
    """Serve /metrics from each worker of `app` when JOBFENCE_METRICS_PORT is set."""
    from celery import signals

    from jobfence.worker.signals import keep_alive

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app and runtime.settings.metrics_port is not None:
            _start_exporter(app, runtime, sender.pool_cls)

    def on_process_init(**_: Any) -> None:
        exporter = exporter_of(app)
        if exporter is not None:
            exporter.in_child()

    def on_process_shutdown(**_: Any) -> None:
        exporter = exporter_of(app)
        if exporter is not None:
            exporter.child_exiting()

    def on_worker_shutdown(sender: Any = None, **_: Any) -> None:
        exporter = exporter_of(app)
        if exporter is not None and getattr(sender, "app", None) is app:
            exporter.stop()
            setattr(app, EXPORTER_ATTRIBUTE, None)

    keep_alive(app, on_worker_init, on_process_init, on_process_shutdown, on_worker_shutdown)
    signals.worker_init.connect(on_worker_init, weak=True)
    signals.worker_process_init.connect(on_process_init, weak=True)
    signals.worker_process_shutdown.connect(on_process_shutdown, weak=True)
    signals.worker_shutdown.connect(on_worker_shutdown, weak=True)


def _start_exporter(app: Any, runtime: Runtime, pool_cls: Any) -> None:
    """At a worker's start, before its pool forks: serve `app`'s /metrics (once), or refuse
    the worker (exit status 78) when the port is taken or the files have no directory."""
    from jobfence.config.errors import EX_CONFIG

    if exporter_of(app) is not None:
        return
    try:
        exporter = Exporter.start(runtime, multiprocess=forks(pool_cls))
    except UnsafeSettings as exc:  # the port is taken, or no directory for the files
        print(f"jobfence: refusing to start the worker\n  - {exc}", file=sys.stderr,
              flush=True)  # fmt: skip
        raise SystemExit(EX_CONFIG) from None
    setattr(app, EXPORTER_ATTRIBUTE, exporter)
