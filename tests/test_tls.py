"""rediss:// failures hint at TLS, on real servers: a plaintext one, and TLS with a private CA."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from jobfence.config import Settings
from jobfence.locks import BackendUnavailable, RedisBackend
from jobfence.locks.backends.redis import tls_hint
from jobfence.tasks import Runtime
from jobfence.worker.checks import check_lock_backend
from tests.servers import RedisServer, free_port

TIMEOUT = 1.0  # a plaintext server never answers the handshake: fail fast


class TlsServer:
    """A private redis-server answering TLS on `tls_port` with a certificate of our own CA."""

    def __init__(self, server: RedisServer, tls_port: int, ca: Path) -> None:
        self.server, self.tls_port, self.ca = server, tls_port, ca

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0"


def _make_certificate(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA): (cert, key)."""
    cert, key = where / "server.pem", where / "server.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TlsServer]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = _make_certificate(tmp_path)
    tls_port = free_port()
    tls_args = [
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(cert),
        "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert),
        "--tls-auth-clients", "no",
    ]  # fmt: skip
    with RedisServer(extra_args=tls_args) as server:
        yield TlsServer(server, tls_port, cert)


def _acquire_error(url: str) -> str:
    backend = RedisBackend.from_url(url, socket_timeout=TIMEOUT)
    try:
        with pytest.raises(BackendUnavailable) as failed:
            backend.try_acquire("tls-probe", 5)
    finally:
        backend.close()
    return str(failed.value)


def test_rediss_to_a_plaintext_server_hints_at_tls(fresh_redis: RedisServer) -> None:
    # Control: the same server over plain redis:// works.
    plain = RedisBackend.from_url(fresh_redis.url, socket_timeout=TIMEOUT)
    try:
        assert plain.try_acquire("tls-probe", 5) is not None
    finally:
        plain.close()
    text = _acquire_error(fresh_redis.url.replace("redis://", "rediss://"))
    assert "TLS handshake with the lock server failed" in text
    assert "redis://, not rediss://" in text
    assert "?ssl_ca_certs=/path/ca.pem" in text


def test_a_refused_connection_gets_no_tls_hint() -> None:
    text = _acquire_error(f"rediss://127.0.0.1:{free_port()}/0")
    assert "TLS" not in text


def test_a_private_ca_certificate_hints_at_the_ca_file_and_the_hint_works(
    tls_server: TlsServer,
) -> None:
    text = _acquire_error(tls_server.url)
    assert "its certificate did not verify" in text
    assert "ssl_ca_certs=/path/ca.pem" in text
    # What the hint says to do, done: the CA file in the URL, and the lock is granted.
    backend = RedisBackend.from_url(f"{tls_server.url}?ssl_ca_certs={tls_server.ca}")
    try:
        lease = backend.try_acquire("tls-probe", 5)
        assert lease is not None and lease.fence > 0
        assert lease.release()
    finally:
        backend.close()


def test_the_start_up_check_gives_the_tls_hint_as_the_fix(fresh_redis: RedisServer) -> None:
    url = fresh_redis.url.replace("redis://", "rediss://")
    runtime = Runtime(
        Settings(
            lock_url=url, socket_timeout=TIMEOUT, key_secret="a-real-random-secret-0123456789ab"
        )
    )
    try:
        (finding,) = check_lock_backend(conf=_Conf(), runtime=runtime)
    finally:
        runtime.close()
    assert finding.refuse and finding.setting == "JOBFENCE_LOCK_URL"
    assert finding.fix.startswith("TLS handshake with the lock server failed")


class _Conf:
    task_always_eager = False


def _chained(outer: Exception, inner: BaseException) -> Exception:
    outer.__cause__ = inner
    return outer


def test_an_ssl_error_on_an_open_connection_is_no_handshake_problem() -> None:
    # A server that went away mid-reply on a TLS connection: redis-py's read error.
    mid_reply = _chained(
        RedisConnectionError("Error while reading from 10.0.0.1:6380"),
        ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:2427)"),
    )
    assert tls_hint(mid_reply) is None
    at_connect = _chained(
        RedisConnectionError("Error 1 connecting to 10.0.0.1:6380. [SSL: WRONG_VERSION_NUMBER]"),
        ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)"),
    )
    assert (tls_hint(at_connect) or "").startswith("TLS handshake with the lock server failed")
