"""etcd over verified TLS with client certificates and user/password auth, on a private etcd."""

from __future__ import annotations

import logging
import time
import urllib.error
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from devstack.local_etcd import (
    EtcdCluster,
    EtcdServerError,
    EtcdTLS,
    client_certificate,
    etcd_unavailable,
    server_certificate,
)
from devstack.pki import Pki, make_pki
from devstack.servers import ETCD_TIMING
from jobfence.config import UnsafeSettings
from jobfence.config.urls import check_lock_url
from jobfence.locks import LockError, Security, open_backend
from jobfence.locks.backends.etcd import TLS, EtcdBackend, SetupError, parse_target

USER = "jf"
PASSWORD = "etcd-pw:s3cret@/77"  # ':' '@' '/' percent-encoded in URLs; never in a message
ROOT_PASSWORD = "etcd-root-pw-99"
TOKEN_TTL = 2  # --auth-token-ttl: a simple token unused this long is dropped
SECRETS = (PASSWORD, quote(PASSWORD, safe=""), ROOT_PASSWORD)


@dataclass(frozen=True)
class Secured:
    pki: Pki
    cert: Path  # a client certificate without a CN (see client_certificate)
    key: Path
    etcd: EtcdCluster  # TLS, --client-cert-auth, auth on; also answers on 127.0.0.2
    port: str

    def url(self, query: str | None = None, *, host: str = "127.0.0.1",
            userinfo: str | None = None) -> str:  # fmt: skip
        if userinfo is None:
            userinfo = f"{USER}:{quote(PASSWORD, safe='')}@"
        if query is None:
            query = f"cacert={self.pki.ca}&cert={self.cert}&key={self.key}"
        return f"etcds://{userinfo}{host}:{self.port}" + (f"?{query}" if query else "")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    reason = etcd_unavailable()
    if reason:
        pytest.skip(reason)
    where = tmp_path_factory.mktemp("etcd-pki")
    pki = make_pki(where)
    cert, key = server_certificate(pki, where)
    client, client_key = client_certificate(pki, where)
    tls = EtcdTLS(pki.ca, cert, key, client_cert_auth=True, client_cert=client,
                  client_key=client_key)  # fmt: skip
    etcd = EtcdCluster(**ETCD_TIMING, tls=tls, also_listen=["127.0.0.2"],
                       extra_args=["--auth-token-ttl", str(TOKEN_TTL)])  # fmt: skip
    try:
        etcd.start()
    except EtcdServerError as exc:
        pytest.skip(f"cannot start a private etcd here: {exc}")
    try:
        etcd.enable_auth(ROOT_PASSWORD, {USER: (PASSWORD, "jobfence/")})
        yield Secured(pki, client, client_key, etcd, etcd.endpoints[0].rpartition(":")[2])
    finally:
        etcd.stop(kill=True)


@pytest.fixture(autouse=True)
def no_secret_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    # (caplog.text here would hold the teardown's records only: read the test's own)
    messages = [r.getMessage() for when in ("setup", "call") for r in caplog.get_records(when)]
    for secret in SECRETS:
        assert not [m for m in messages if secret in m]


def _prefix() -> str:
    return f"jobfence/{uuid.uuid4().hex[:8]}"  # the user's role covers jobfence/


def _refusal(url: str, prefix: str | None = None) -> tuple[str, tuple[str, str]]:
    """The error of a first acquire through `url`, and the start-up check's (problem, fix);
    neither may hold a password."""
    backend = open_backend(url, prefix=prefix or _prefix(), socket_timeout=2.0)
    try:
        with pytest.raises(LockError) as refused:
            backend.try_acquire("payments:42", 5)
        assert isinstance(backend, EtcdBackend)
        ((problem, fix),) = backend.server_problems()
    finally:
        backend.close()
    text = f"{refused.value} {refused.value!r} {problem} {fix}"
    for secret in SECRETS:
        assert secret not in text
    assert isinstance(refused.value, SetupError), text
    return str(refused.value), (problem, fix)


# --------------------------------------------------------------------------- URLs


def test_urls_spell_tls_as_etcds_with_etcdctls_option_names_and_auth_as_user_info() -> None:
    userinfo = f"{USER}:{quote(PASSWORD, safe='')}"
    url = f"etcds://{userinfo}@a:2379,b:2379?cacert=/ca.pem&cert=/c.pem&key=/c.key"
    check_lock_url(url, "JOBFENCE_LOCK_URL")
    target = parse_target(url)
    assert target.endpoints == ["a:2379", "b:2379"]
    assert (target.user, target.password) == (USER, PASSWORD)
    assert target.tls == TLS("/ca.pem", "/c.pem", "/c.key", verify=True)
    assert PASSWORD not in repr(target)
    assert parse_target("etcds://a:2379").tls == TLS()  # the system's CAs, checks on
    assert parse_target("etcd://a:2379").tls is None
    skip = parse_target("etcds://a:2379?insecure_skip_tls_verify=true").tls
    assert skip is not None and not skip.verify


@pytest.mark.parametrize(
    ("url", "problem", "fix"),
    [
        ("etcd://a:2379?password=hunter2-pw", "option 'password'", "etcds://user:password@"),
        ("etcd://jf:hunter2-pw@a:2379?user=jf", "option 'user'", "etcds://user:password@"),
        ("etcd://jf@a:2379", "not user:password", "etcds://user:password@"),
        ("etcd://jf:hunter2-pw@a:2379?cacert=/ca.pem", "etcd://, which is plain HTTP",
         "etcds://"),
        ("etcds://a:2379?sslmode=verify", "option 'sslmode'", "cacert"),
    ],
)  # fmt: skip
def test_credentials_in_the_query_and_tls_options_on_plain_http_are_refused(
    url: str, problem: str, fix: str
) -> None:
    with pytest.raises(UnsafeSettings) as refused:
        check_lock_url(url, "JOBFENCE_LOCK_URL")
    assert problem in str(refused.value) and fix in str(refused.value)
    with pytest.raises(ValueError) as also:
        open_backend(url)
    assert problem in str(also.value)
    for text in (str(refused.value), str(also.value)):
        assert "hunter2-pw" not in text


def test_a_client_key_without_its_certificate_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cert=/path/client\.pem&key=/path/client\.key"):
        parse_target("etcds://a:2379?key=/c.key")
    with pytest.raises(LockError, match=r"cacert=/no/such\.pem cannot be used"):
        open_backend("etcds://a:2379?cacert=/no/such.pem")


# --------------------------------------------------------------------------- a secured etcd


def test_right_ca_client_certificate_and_password_take_extend_and_release(
    secured: Secured,
) -> None:
    backend = open_backend(secured.url(), prefix=_prefix(), socket_timeout=2.0)
    assert isinstance(backend, EtcdBackend)
    try:
        assert backend.security() == Security(tls=True, verified=True, hostname_checked=True,
                                               auth=True)  # fmt: skip
        assert backend.server_problems() == []
        fences = []
        for _ in range(3):
            lease = backend.try_acquire("payments:42", 5)
            assert lease is not None
            fences.append(lease.fence)
            assert backend.try_acquire("payments:42", 5) is None  # held
            lease.extend(5)  # raises LeaseLost if not ours
            assert lease.release()
        assert fences == sorted(set(fences))
        assert backend.gateway.authentications == 1  # one token, reused on every request
        assert backend.gateway.connections <= 3  # keep-alive HTTPS, no handshake per request
    finally:
        backend.close()


def test_a_wrong_ca_is_refused_naming_cacert(secured: Secured) -> None:
    query = f"cacert={secured.pki.other_ca}&cert={secured.cert}&key={secured.key}"
    text, (_, fix) = _refusal(secured.url(query))
    assert "did not verify" in text and "cacert=/path/ca.pem" in fix


def test_a_wrong_host_name_is_refused_and_skipping_the_check_is_a_spelled_out_downgrade(
    secured: Secured,
) -> None:
    _, (problem, fix) = _refusal(secured.url(host="127.0.0.2"))
    assert "not valid for host '127.0.0.2'" in problem and "insecure_skip_tls_verify" in fix
    # Control: the same server, certificate unchecked, takes the lock (and says so).
    query = f"insecure_skip_tls_verify=true&cert={secured.cert}&key={secured.key}"
    backend = open_backend(secured.url(query, host="127.0.0.2"), prefix=_prefix())
    try:
        assert backend.security() == Security(tls=True, verified=False, hostname_checked=False,
                                               auth=True)  # fmt: skip
        assert backend.try_acquire("payments:42", 5) is not None
    finally:
        backend.close()


def test_a_missing_client_certificate_is_refused_naming_cert_and_key(secured: Secured) -> None:
    _, (problem, fix) = _refusal(secured.url(f"cacert={secured.pki.ca}"))
    assert "client certificate" in problem and "cert=/path/client.pem&key=" in fix


def test_a_client_certificate_with_a_common_name_is_refused_by_etcds_gateway(
    secured: Secured,
) -> None:
    pki = secured.pki
    query = f"cacert={pki.ca}&cert={pki.client_cert}&key={pki.client_key}"
    _, (problem, fix) = _refusal(secured.url(query))
    assert "Common Name" in problem and "with no CN" in fix


def test_a_wrong_password_is_refused_naming_the_user_info(secured: Secured) -> None:
    wrong = "not-the-pw-4242"
    text, (problem, fix) = _refusal(secured.url(userinfo=f"{USER}:{wrong}@"))
    assert wrong not in text and wrong not in problem
    assert f"refused the login of user '{USER}'" in problem
    assert "user and password in the lock URL" in fix


def test_no_user_against_auth_is_refused_naming_the_user_info(secured: Secured) -> None:
    _, (problem, fix) = _refusal(secured.url(userinfo=""))
    assert "names no user" in problem and "etcds://user:password@" in fix


def test_a_prefix_outside_the_users_role_is_refused_naming_the_grant(secured: Secured) -> None:
    _, (problem, fix) = _refusal(secured.url(), prefix="elsewhere")
    assert f"denies user '{USER}'" in problem and "grant-permission" in fix


def test_plain_http_to_the_tls_port_is_refused_at_start_up_naming_etcds(
    secured: Secured,
) -> None:
    backend = open_backend(f"etcd://127.0.0.1:{secured.port}", prefix=_prefix())
    assert isinstance(backend, EtcdBackend)
    try:
        ((problem, fix),) = backend.server_problems()
    finally:
        backend.close()
    assert "serves HTTPS" in problem and fix.startswith("use etcds://")


def test_an_expired_token_is_renewed_once_and_transparently(secured: Secured) -> None:
    backend = open_backend(secured.url(), prefix=_prefix(), socket_timeout=2.0)
    assert isinstance(backend, EtcdBackend)
    try:
        lease = backend.try_acquire("payments:42", 8)
        assert lease is not None and backend.gateway.authentications == 1
        token = backend.gateway._tokens[0]
        # etcd drops a simple token unused for --auth-token-ttl (checked each second); any
        # probe with the token would renew it, so wait out the server's own timer.
        time.sleep(TOKEN_TTL + 1.5)
        # Control: a client that kept the old token is refused now.
        with pytest.raises(urllib.error.HTTPError) as refused:
            secured.etcd.post("/v3/kv/range", {"key": "YQ=="}, token=token)
        assert b"invalid auth token" in refused.value.read()
        lease.extend(8)  # the backend asks for a new token and resends once
        assert backend.gateway.authentications == 2
        assert lease.release()
    finally:
        backend.close()


def test_control_a_plain_etcd_without_auth_reports_no_tls_and_no_auth(etcd_url: str) -> None:
    backend = open_backend(etcd_url, prefix=_prefix())
    try:
        assert backend.security() == Security(False, False, False, False)
    finally:
        backend.close()


def test_a_waiter_watches_with_its_token(secured: Secured) -> None:
    """The watch carries the token too: a refused one would sleep its whole timeout."""
    prefix = _prefix()
    holder = open_backend(secured.url(), prefix=prefix, socket_timeout=2.0)
    waiter = open_backend(secured.url(), prefix=prefix, socket_timeout=2.0)
    try:
        lease = holder.try_acquire("payments:42", 8)
        assert lease is not None
        assert waiter.try_acquire("payments:42", 8) is None  # the watch starts from here
        # A watch etcd accepted stays open while the key is held (one without the token
        # is cancelled at once, which reads as "look again").
        assert isinstance(waiter, EtcdBackend)
        assert not waiter.gateway.wait_deleted(f"{prefix}/lock/payments:42".encode(), 1, 1.0)
        assert lease.release()
        started = time.monotonic()
        waiter.wait_for_release("payments:42", 10.0)
        assert time.monotonic() - started < 5.0  # woken by the delete, not the timeout
        assert waiter.try_acquire("payments:42", 8) is not None
    finally:
        holder.close()
        waiter.close()
