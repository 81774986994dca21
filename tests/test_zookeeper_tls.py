"""ZooKeeper over TLS on a private server (secureClientPort, Netty): verified or refused by name."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.security import OPEN_ACL_UNSAFE

from devstack import local_zookeeper
from devstack.local_zookeeper import ZooKeeperServer, ZooKeeperTls
from devstack.pki import Pki, make_pki
from jobfence.locks import BackendUnavailable, LockError, Security, open_backend
from jobfence.locks.backends.zookeeper import TLSRefused, ZooKeeperBackend

USER = "jobfence"
PASSWORD = "zk-tls:pw@s3cret/42"  # percent-encoded in the URL; never in a message or log line


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("zk-pki"))


def _server(pki: Pki, cert: Path, key: Path) -> Iterator[ZooKeeperServer]:
    reason = local_zookeeper.unavailable(tls=True)
    if reason is not None:
        pytest.skip(reason)
    with ZooKeeperServer(tls=ZooKeeperTls(cert, key, pki.ca, client_auth="need")) as server:
        yield server


@pytest.fixture(scope="module")
def zk(pki: Pki) -> Iterator[ZooKeeperServer]:
    """TLS on its secure port with a certificate for localhost and 127.0.0.1, client
    certificates of `pki`'s CA required (ssl.clientAuth=need)."""
    yield from _server(pki, pki.server_cert, pki.server_key)


@pytest.fixture(scope="module")
def wrong_name_zk(pki: Pki) -> Iterator[ZooKeeperServer]:
    """The same set-up with a certificate (of the right CA) for wrong.example only."""
    yield from _server(pki, pki.wrong_name_cert, pki.wrong_name_key)


@pytest.fixture(autouse=True)
def no_secret_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)  # kazoo logs each request it sends at DEBUG
    yield
    # (caplog.text here would hold the teardown's records only: read the test's own)
    messages = [r.getMessage() for when in ("setup", "call") for r in caplog.get_records(when)]
    for message in messages:
        assert PASSWORD not in message and quote(PASSWORD, safe="") not in message


def _url(
    server: ZooKeeperServer,
    pki: Pki,
    *,
    ca: Path | None = None,
    client_cert: bool = True,
    host: str = "127.0.0.1",
    password: str = PASSWORD,
    chroot: str | None = None,
    extra: str = "",
) -> str:
    query = f"ca={ca or pki.ca}"
    if client_cert:
        query += f"&certfile={pki.client_cert}&keyfile={pki.client_key}"
    userinfo = f"{USER}:{quote(password, safe='')}"
    chroot = chroot or f"/tls{uuid.uuid4().hex[:12]}"
    return f"zookeeper://{userinfo}@{host}:{server.secure_port}{chroot}?{query}{extra}"


def _refusal(url: str, socket_timeout: float = 2.0) -> tuple[LockError, tuple[str, str]]:
    """The error of a first acquire through `url` and the start-up check's (problem, fix);
    neither may hold the password."""
    backend = open_backend(url, socket_timeout=socket_timeout)
    assert isinstance(backend, ZooKeeperBackend)
    try:
        with pytest.raises(LockError) as refused:
            backend.try_acquire("payments:42", 5)
        ((problem, fix),) = backend.server_problems([5.0])
    finally:
        backend.close()
    text = f"{refused.value} {refused.value!r} {problem} {fix}"
    assert PASSWORD not in text and quote(PASSWORD, safe="") not in text
    return refused.value, (problem, fix)


def _naive(server: ZooKeeperServer, pki: Pki, hosts: str, **options: object) -> KazooClient:
    """A bare KazooClient, kazoo's defaults but for `options` (the controls)."""
    client = KazooClient(hosts, timeout=2.0, use_ssl=True, ca=str(pki.ca), **options)  # type: ignore[arg-type]
    client.start(timeout=2.0)
    return client


# --------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_the_right_ca_certificate_and_password_lock_extend_release_with_rising_fences(
    zk: ZooKeeperServer, pki: Pki, host: str
) -> None:
    backend = open_backend(_url(zk, pki, host=host), socket_timeout=2.0)
    assert isinstance(backend, ZooKeeperBackend)
    try:
        assert backend.security() == Security(tls=True, verified=True, hostname_checked=True,
                                               auth=True)  # fmt: skip
        assert backend.server_problems([5.0]) == []
        fences = []
        for _ in range(3):
            lease = backend.try_acquire("payments:42", 5)
            assert lease is not None
            assert backend.try_acquire("payments:42", 5) is None  # held
            backend.extend(lease, 5)
            assert backend.release(lease)
            fences.append(lease.fence)
        assert fences == sorted(fences) and len(set(fences)) == 3
    finally:
        backend.close()


def test_digest_acls_hold_over_tls_against_a_client_with_a_trusted_certificate(
    zk: ZooKeeperServer, pki: Pki
) -> None:
    """A client certificate lets a client in (ZooKeeper's x509 identity), not at the nodes:
    they are the digest identity's alone."""
    chroot = f"/tls{uuid.uuid4().hex[:12]}"
    backend = open_backend(_url(zk, pki, chroot=chroot), socket_timeout=2.0)
    other = _naive(zk, pki, zk.secure_address, certfile=str(pki.client_cert),
                   keyfile=str(pki.client_key))  # fmt: skip
    try:
        assert backend.try_acquire("payments:42", 5) is not None
        with pytest.raises(NoAuthError):
            other.set_acls(f"{chroot}/jobfence/fence-base", OPEN_ACL_UNSAFE)
    finally:
        other.stop()
        other.close()
        backend.close()


def test_a_certfile_holding_the_key_too_is_enough(
    zk: ZooKeeperServer, pki: Pki, tmp_path: Path
) -> None:
    """kazoo loads a client certificate only given a keyfile as well; one PEM with both is
    passed as both."""
    both = tmp_path / "client-and-key.pem"
    both.write_text(pki.client_cert.read_text() + pki.client_key.read_text())
    url = _url(zk, pki, client_cert=False, extra=f"&certfile={both}")
    backend = open_backend(url, socket_timeout=2.0)
    try:
        assert backend.try_acquire("payments:42", 5) is not None
    finally:
        backend.close()


# --------------------------------------------------------------------------- refused


def test_another_ca_is_refused_naming_the_ca_option(zk: ZooKeeperServer, pki: Pki) -> None:
    error, (problem, fix) = _refusal(_url(zk, pki, ca=pki.other_ca))
    assert isinstance(error, TLSRefused)
    assert f"ZooKeeper's TLS certificate at 127.0.0.1:{zk.secure_port} did not verify" in problem
    assert "ca=/path/ca.pem in the lock URL" in fix and fix in str(error)


def test_a_certificate_for_another_host_name_is_refused_naming_check_hostname(
    wrong_name_zk: ZooKeeperServer, pki: Pki
) -> None:
    error, (problem, fix) = _refusal(_url(wrong_name_zk, pki))
    assert isinstance(error, TLSRefused)
    assert "is not valid for host '127.0.0.1'" in problem and "mismatch" in problem
    assert "connect by a name or address the certificate holds" in fix
    assert "check_hostname=false" in fix
    # The downgrade the fix names does connect, and says so in security().
    backend = open_backend(_url(wrong_name_zk, pki, extra="&check_hostname=false"))
    try:
        assert backend.security() == Security(tls=True, verified=True, hostname_checked=False,
                                               auth=True)  # fmt: skip
        assert backend.try_acquire("payments:42", 5) is not None
    finally:
        backend.close()


def test_control_kazoos_default_takes_a_certificate_for_another_host_name(
    wrong_name_zk: ZooKeeperServer, pki: Pki
) -> None:
    """Control: kazoo alone leaves check_hostname off, so the same server is accepted; jobfence
    turns the check on."""
    client = _naive(wrong_name_zk, pki, wrong_name_zk.secure_address,
                    certfile=str(pki.client_cert), keyfile=str(pki.client_key))  # fmt: skip
    try:
        assert client.connected
    finally:
        client.stop()
        client.close()


def test_no_client_certificate_is_refused_naming_certfile(zk: ZooKeeperServer, pki: Pki) -> None:
    error, (problem, fix) = _refusal(_url(zk, pki, client_cert=False))
    assert isinstance(error, TLSRefused)
    assert f"ZooKeeper at 127.0.0.1:{zk.secure_port} refused the TLS session" in problem
    assert "ssl.clientAuth=need" in problem and "none was given" in problem
    assert "certfile=/path/client.pem&keyfile=/path/client.key in the lock URL" in fix


def test_control_kazoo_alone_says_only_connection_time_out(zk: ZooKeeperServer, pki: Pki) -> None:
    """Control: what the mapping replaces; kazoo retries the refused handshake until its
    timeout and names no cause."""
    with pytest.raises(KazooTimeoutError, match=r"^Connection time-out$"):
        _naive(zk, pki, zk.secure_address, check_hostname=True)


def test_a_refusal_by_every_member_does_not_wait_out_the_timeout(
    zk: ZooKeeperServer, pki: Pki
) -> None:
    started = time.monotonic()
    error, _ = _refusal(_url(zk, pki, client_cert=False), socket_timeout=20.0)
    assert isinstance(error, TLSRefused)
    assert time.monotonic() - started < 10.0  # two refusals (acquire, check), not 2 x 20 s


def test_tls_to_the_plain_port_is_refused_naming_the_secure_port(
    zk: ZooKeeperServer, pki: Pki
) -> None:
    url = _url(zk, pki).replace(f":{zk.secure_port}/", f":{zk.port}/")
    error, (problem, fix) = _refusal(url)
    assert isinstance(error, TLSRefused)
    assert "closed the TLS handshake" in problem and "plain clientPort" in problem
    assert "secureClientPort in the lock URL" in fix


def test_plain_text_to_the_tls_port_says_to_turn_tls_on(zk: ZooKeeperServer) -> None:
    url = f"zookeeper://{USER}:{quote(PASSWORD, safe='')}@{zk.secure_address}/plain"
    backend = open_backend(url, socket_timeout=1.0)
    try:
        with pytest.raises(BackendUnavailable) as down:
            backend.try_acquire("payments:42", 5)
    finally:
        backend.close()
    assert "use_ssl=true&ca=/path/ca.pem" in str(down.value)
    assert PASSWORD not in str(down.value)


def test_a_wrong_password_over_tls_is_refused_by_name_without_the_secret(
    zk: ZooKeeperServer, pki: Pki
) -> None:
    chroot = f"/tls{uuid.uuid4().hex[:12]}"
    backend = open_backend(_url(zk, pki, chroot=chroot), socket_timeout=2.0)
    try:
        assert backend.try_acquire("payments:42", 5) is not None
    finally:
        backend.close()
    wrong = "not-the-pw-777"
    backend = open_backend(_url(zk, pki, password=wrong, chroot=chroot), socket_timeout=2.0)
    try:
        with pytest.raises(LockError) as refused:
            backend.try_acquire("payments:42", 5)
    finally:
        backend.close()
    text = f"{refused.value} {refused.value!r}"
    assert f"to user '{USER}' (NoAuth)" in text and "lock URL" in text
    assert wrong not in text and PASSWORD not in text


def test_an_unreadable_ca_file_is_refused_before_connecting(
    zk: ZooKeeperServer, pki: Pki, tmp_path: Path
) -> None:
    error, (problem, fix) = _refusal(_url(zk, pki, ca=tmp_path / "missing-ca.pem"))
    assert isinstance(error, TLSRefused)
    assert "ca=" in problem and "does not exist" in problem and "readable PEM" in fix


def test_kazoos_debug_log_of_the_login_hides_the_password(
    zk: ZooKeeperServer, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """kazoo logs the digest Auth request at DEBUG with user:password in it; jobfence's
    clients log it with the password hidden (the autouse fixture checks every test's log)."""
    backend = open_backend(_url(zk, pki), socket_timeout=2.0)
    try:
        assert backend.try_acquire("payments:42", 5) is not None
    finally:
        backend.close()
    assert f"auth='{USER}:<hidden>'" in caplog.text
