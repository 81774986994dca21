"""The /metrics exporter's parts: settings, the single-process endpoint, the pool collector."""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from devstack.pki import Pki, make_pki
from devstack.redis_server import free_port
from jobfence.config import Settings, UnsafeSettings
from jobfence.tasks import Runtime
from jobfence.tasks.metrics import MAX_NAMES, OTHER, Metrics
from jobfence.worker import metrics_server
from jobfence.worker.metrics_server import Exporter, MetricsPortUnavailable, PoolCollector
from tests.servers import wait_for
from tests.tasks.conftest import spec_for, unique

_mmap: Any = importlib.import_module("prometheus_client.mmap_dict")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def sample(registry: Any, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_a_metrics_port_outside_the_tcp_range_is_refused(port: int) -> None:
    with pytest.raises(UnsafeSettings) as refused:
        Settings(lock_url="memory://", metrics_port=port)
    assert refused.value.field == "JOBFENCE_METRICS_PORT"
    assert "1 to 65535" in str(refused.value)


def test_a_metrics_port_a_local_server_uses_is_refused() -> None:
    with pytest.raises(UnsafeSettings) as refused:
        Settings(lock_url="redis://127.0.0.1:6390/0", metrics_port=6390)
    assert refused.value.field == "JOBFENCE_METRICS_PORT"
    assert "JOBFENCE_LOCK_URL" in str(refused.value)
    with pytest.raises(UnsafeSettings, match="JOBFENCE_DATABASE_URL"):
        Settings(lock_url="memory://", database_url="postgresql://u:pw@localhost:5432/x",
                 metrics_port=5432)  # fmt: skip
    # Another host's port is no clash, and no port is no endpoint.
    remote = Settings(
        lock_url="rediss://:pw@10.0.0.9:9816/0", key_secret="k" * 32, metrics_port=9816
    )
    assert remote.metrics_port == 9816
    assert Settings(lock_url="memory://").metrics_port is None


def test_a_metrics_address_that_is_no_ip_is_refused() -> None:
    with pytest.raises(UnsafeSettings) as refused:
        Settings(lock_url="memory://", metrics_port=9816, metrics_addr="every interface")
    assert refused.value.field == "JOBFENCE_METRICS_ADDR"


def test_only_the_prefork_pool_forks() -> None:
    from celery.concurrency.prefork import TaskPool

    assert metrics_server.forks("prefork") and metrics_server.forks(TaskPool)
    assert not metrics_server.forks("threads") and not metrics_server.forks("solo")
    assert not metrics_server.forks("no-such-pool")


# --------------------------------------------------------------------------- Metrics API


def test_semaphore_slots_and_rate_limits_are_recorded_by_declared_name() -> None:
    m = Metrics()
    m.semaphore_acquired("reports", limit=3)
    m.semaphore_acquired("reports")
    m.semaphore_released("reports")
    with pytest.raises(RuntimeError), m.holding_slot("exports", limit=2):
        assert sample(m.registry, "jobfence_semaphore_slots_held", semaphore="exports") == 1
        raise RuntimeError("the body failed")
    m.rate_limit_waited("mail", 0.2)
    m.rate_limit_waited("mail", -1.0)  # a clock step never makes a negative wait
    m.rate_limit_denied("mail", "skip")
    r = m.registry
    assert sample(r, "jobfence_semaphore_slots_held", semaphore="reports") == 1
    assert sample(r, "jobfence_semaphore_limit", semaphore="reports") == 3
    assert sample(r, "jobfence_semaphore_slots_held", semaphore="exports") == 0
    assert sample(r, "jobfence_rate_limit_wait_seconds_count", limit="mail") == 2
    assert sample(r, "jobfence_rate_limit_wait_seconds_sum", limit="mail") == pytest.approx(0.2)
    assert sample(r, "jobfence_rate_limit_denials_total", limit="mail", action="skip") == 1


def test_names_past_the_cap_are_counted_as_other(caplog: pytest.LogCaptureFixture) -> None:
    m = Metrics()
    with caplog.at_level(logging.WARNING, logger="jobfence.tasks.metrics"):
        for i in range(MAX_NAMES + 5):
            m.rate_limit_denied(f"account-{i}")
    r = m.registry
    assert sample(r, "jobfence_rate_limit_denials_total", limit="account-0", action="retry") == 1
    assert sample(r, "jobfence_rate_limit_denials_total", limit=OTHER, action="retry") == 5
    assert [rec.message for rec in caplog.records].count(caplog.records[0].message) == 1
    assert "never by a key" in caplog.records[0].message


def test_rebuild_zeroes_every_metric_on_the_same_registry() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.task("t").done.inc()
    m.lost_leases.inc()
    m.rebuild()
    assert m.registry is registry
    assert sample(registry, "jobfence_executions_total", task="t", outcome="done") == 0
    m.task("t").done.inc()  # the hot-path cache points at the new series
    assert sample(registry, "jobfence_executions_total", task="t", outcome="done") == 1
    assert sample(registry, "jobfence_lost_leases_total") == 0


# --------------------------------------------------------------------------- single process


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = Runtime(Settings(lock_url="memory://", key_prefix=f"ms{unique()[-8:]}"))
    yield rt
    rt.close()


def test_a_single_process_worker_serves_its_runtime_and_the_default_registry(
    runtime: Runtime,
) -> None:
    port = free_port()
    exporter = Exporter.start(runtime, multiprocess=False, port=port)
    try:
        key = unique("secret-key")
        assert runtime.executor.run(spec_for(key), lambda ctx: "ok").status == "ran"
        assert runtime.executor.run(spec_for(key), lambda ctx: "again").status == "replayed"
        text = scrape(port)
        assert 'jobfence_executions_total{outcome="done",task="tests.job"} 1.0' in text
        assert 'jobfence_idempotent_replays_total{task="tests.job"} 1.0' in text
        assert "process_cpu_seconds_total" in text or "python_info" in text  # the default one
        assert key not in text
        assert exporter.path is None  # no files in one process
    finally:
        exporter.stop()
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_a_taken_port_is_refused_naming_the_setting(runtime: Runtime) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsPortUnavailable) as refused:
            Exporter.start(runtime, multiprocess=False, port=port)
    assert refused.value.field == "JOBFENCE_METRICS_PORT"
    assert f"127.0.0.1:{port}" in str(refused.value) or f":{port}" in str(refused.value)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


def _tls_scrape(port: int, pki: Pki, timeout: float) -> str:
    context = ssl.create_default_context(cafile=str(pki.ca))
    url = f"https://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, context=context, timeout=timeout) as reply:
        return str(reply.read().decode())


def test_an_idle_connection_blocks_neither_https_scrapes_nor_shutdown(pki: Pki) -> None:
    port = free_port()
    runtime = Runtime(Settings(lock_url="memory://", metrics_port=port,
                               metrics_certfile=str(pki.server_cert),
                               metrics_keyfile=str(pki.server_key)))  # fmt: skip
    exporter = Exporter.start(runtime, multiprocess=False)
    idle = socket.create_connection(("127.0.0.1", port))  # connects, never says a word
    stopper = threading.Thread(target=exporter.stop, name="stopper", daemon=True)
    try:
        assert "jobfence" in _tls_scrape(port, pki, timeout=5)
        stopper.start()
        wait_for(lambda: not stopper.is_alive(), 5, message="the exporter's stop hangs")
    finally:
        idle.close()  # a server that blocked on it (main's) is unblocked, so it can stop
        if not stopper.is_alive() and exporter._server is not None:
            exporter.stop()
        runtime.close()


def test_control_a_tls_listening_socket_blocks_on_one_idle_connection(pki: Pki) -> None:
    # Main's way: the listening socket wrapped, so `accept()` shakes hands on the one
    # serving thread, with no timeout.
    from wsgiref.simple_server import make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    httpd = make_server("127.0.0.1", 0, lambda env, start: [b""], ThreadingWSGIServer)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(pki.server_cert), str(pki.server_key))
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    serving = threading.Thread(target=httpd.serve_forever, name="naive", daemon=True)
    serving.start()
    idle = socket.create_connection(("127.0.0.1", httpd.server_port))
    try:
        with pytest.raises(OSError):  # URLError or a timeout: nobody answers the scrape
            _tls_scrape(httpd.server_port, pki, timeout=1)
    finally:
        idle.close()  # its handshake fails, the loop goes on and sees the shutdown
        httpd.shutdown()
        httpd.server_close()


# --------------------------------------------------------------------------- pool collector


def _write(path: Path, metric: str, name: str, labels: dict[str, str], value: float) -> None:
    key = json.dumps([metric, name, labels, "help"], sort_keys=True)
    d = _mmap.MmapedDict(str(path))
    try:
        d.write_value(key, value, 0.0)
    finally:
        d.close()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _collected(collector: PoolCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }


def test_an_exited_pool_process_keeps_its_counts_and_drops_its_live_gauges(
    tmp_path: Path,
) -> None:
    dead, live = _dead_pid(), os.getpid()
    done = {"task": "t", "outcome": "done"}
    runs = "jobfence_executions"
    for pid, n in ((dead, 3.0), (live, 4.0)):
        _write(tmp_path / f"counter_{pid}.db", runs, f"{runs}_total", done, n)
        _write(tmp_path / f"gauge_livesum_{pid}.db", "jobfence_semaphore_slots_held",
               "jobfence_semaphore_slots_held", {"semaphore": "s"}, n - 2)  # fmt: skip
    collector = PoolCollector(str(tmp_path))
    total = (f"{runs}_total", tuple(sorted(done.items())))
    held = ("jobfence_semaphore_slots_held", (("semaphore", "s"),))
    first = _collected(collector)
    assert first[total] == 7.0  # both processes' runs
    assert first[held] == 2.0  # only the live process's slots
    assert not (tmp_path / f"counter_{dead}.db").exists()  # folded into the archive
    assert (tmp_path / "counter_archive.db").exists()
    assert not (tmp_path / f"gauge_livesum_{dead}.db").exists()
    assert _collected(collector)[total] == 7.0  # folding counts nothing twice


def test_a_zombie_counts_as_exited() -> None:
    from tests.servers import wait_for

    proc = subprocess.Popen(["true"])  # exits at once; unreaped until wait()
    try:
        wait_for(lambda: not metrics_server._alive(proc.pid), timeout=10,
                 message="an exited, unreaped child still looks alive")  # fmt: skip
        assert os.path.exists(f"/proc/{proc.pid}")  # a zombie, not gone
    finally:
        proc.wait()
    assert metrics_server._alive(os.getpid())


def test_the_local_fleet_gives_each_worker_its_own_metrics_port() -> None:
    from demo.fleet import metrics_env

    env = {"JOBFENCE_METRICS_PORT": "9816", "OTHER": "x"}
    assert [metrics_env(env, i)["JOBFENCE_METRICS_PORT"] for i in (1, 2, 3)] == [
        "9816", "9817", "9818",
    ]
    assert metrics_env(env, 2)["OTHER"] == "x"
    assert env["JOBFENCE_METRICS_PORT"] == "9816"  # the shared mapping is left alone
    unset: dict[str, str] = {}
    assert metrics_env(unset, 2) is unset
