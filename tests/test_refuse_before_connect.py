"""Insecure settings are refused before any connection: no password reaches the lock server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

import jobfence
from jobfence.config import load_settings
from jobfence.config.errors import InsecureSettings
from jobfence.config.security import is_loopback
from jobfence.locks import BackendUnavailable, open_backend
from jobfence.tasks import Runtime
from jobfence.worker.admin import open_admin_backend

REPO_ROOT = Path(__file__).resolve().parents[1]
STRONG = "k7Vq2-strong-random-secret-for-tests-0123456789"
PASSWORD = "CLEARpwLISTEN42"


class Listener:
    """A TCP listener standing in for a lock server: it records every byte it is sent."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_server((address, 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.accepted = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                with self._lock:
                    self.received += data

    def got(self) -> bytes:
        with self._lock:
            return bytes(self.received)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def remote() -> Iterator[tuple[Listener, str]]:
    """A listener on this host's name: no loopback literal, so judged another host."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        pytest.skip(f"this host's name {name!r} does not resolve")
    if is_loopback(name):
        pytest.skip(f"this host's name {name!r} is a loopback literal")
    listener = Listener(address)
    try:
        yield listener, f"redis://:{PASSWORD}@{name}:{listener.port}/0?socket_timeout=1"
    finally:
        listener.close()


def env_for(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JOBFENCE_ALLOW_INSECURE"}
    return {**env, "JOBFENCE_LOCK_URL": url, "JOBFENCE_KEY_SECRET": STRONG}


def assert_nothing_sent(listener: Listener) -> None:
    assert listener.accepted == 0 and listener.got() == b"", "a connection went out"


def test_control_open_backend_sends_the_password_in_clear(remote: tuple[Listener, str]) -> None:
    listener, url = remote
    backend = open_backend(url)
    try:
        with pytest.raises(BackendUnavailable):  # the listener never answers
            backend.try_acquire("probe", 5)
    finally:
        backend.close()
    assert b"AUTH" in listener.got() and PASSWORD.encode() in listener.got()


def test_a_runtime_refuses_before_connecting(remote: tuple[Listener, str]) -> None:
    listener, url = remote
    settings = load_settings(lock_url=url, key_secret=STRONG, allow_insecure="")
    with pytest.raises(InsecureSettings) as refused:
        Runtime(settings)
    text = str(refused.value)
    assert "JOBFENCE_LOCK_URL" in text and "JOBFENCE_ALLOW_INSECURE=cleartext" in text
    assert PASSWORD not in text
    assert_nothing_sent(listener)


def test_a_publisher_setup_refuses_before_connecting(remote: tuple[Listener, str]) -> None:
    listener, url = remote
    settings = load_settings(lock_url=url, key_secret=STRONG, allow_insecure="")
    with pytest.raises(InsecureSettings):
        jobfence.setup(Celery("publisher"), settings)
    assert_nothing_sent(listener)


def test_the_admin_backend_refuses_before_connecting(remote: tuple[Listener, str]) -> None:
    listener, url = remote
    settings = load_settings(lock_url=url, key_secret=STRONG, allow_insecure="")
    with pytest.raises(InsecureSettings):
        open_admin_backend(settings)
    assert_nothing_sent(listener)


@pytest.mark.parametrize("command", [("check",), ("locks", "list")])
def test_cli_commands_refuse_before_connecting(
    remote: tuple[Listener, str], command: tuple[str, ...]
) -> None:
    listener, url = remote
    done = subprocess.run(
        [sys.executable, "-m", "jobfence", *command], env=env_for(url), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "JOBFENCE_ALLOW_INSECURE=cleartext" in out and PASSWORD not in out
    assert_nothing_sent(listener)


def test_allowing_the_downgrade_opens_the_connection(remote: tuple[Listener, str]) -> None:
    _listener, url = remote
    settings = load_settings(lock_url=url, key_secret=STRONG, allow_insecure="cleartext")
    Runtime(settings).close()  # allowed: built (connections are opened on first use)


def test_a_worker_exits_78_before_connecting(remote: tuple[Listener, str]) -> None:
    listener, url = remote
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "demo.app", "worker",
         "--pool", "solo", "--concurrency", "1"],
        env=env_for(url), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 78, out[-2000:]
    assert "JOBFENCE_ALLOW_INSECURE=cleartext" in out and PASSWORD not in out
    assert_nothing_sent(listener)
