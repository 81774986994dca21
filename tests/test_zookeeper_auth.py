"""ZooKeeper digest auth on a private server: jobfence's nodes are its identity's alone."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import OPEN_ACL_UNSAFE, Permissions, make_digest_acl_credential

from devstack.local_zookeeper import ZooKeeperServer
from jobfence.locks import LockError, Security, open_backend
from jobfence.locks.backends.zookeeper import ZooKeeperBackend, parse_target

USER = "jobfence"
PASSWORD = "zk-digest:pw@s3cret/99"  # ':' '@' '/' percent-encoded in the URL; never in a message


def _url(server: ZooKeeperServer, chroot: str, user: str = USER, pw: str = PASSWORD) -> str:
    return f"zookeeper://{quote(user, safe='')}:{quote(pw, safe='')}@{server.address}{chroot}"


@pytest.fixture
def chroot() -> str:
    return f"/auth{uuid.uuid4().hex[:12]}"


@pytest.fixture
def anonymous(zookeeper_server: ZooKeeperServer) -> Iterator[KazooClient]:
    client = KazooClient(zookeeper_server.address, timeout=5.0)
    client.start(timeout=10)
    yield client
    client.stop()
    client.close()


@pytest.fixture
def owner(zookeeper_server: ZooKeeperServer) -> Iterator[KazooClient]:
    """A client authenticated as jobfence's identity: to read what the backend wrote."""
    client = KazooClient(zookeeper_server.address, timeout=5.0,
                         auth_data=[("digest", f"{USER}:{PASSWORD}")])  # fmt: skip
    client.start(timeout=10)
    yield client
    client.stop()
    client.close()


def _take_a_lock(url: str) -> ZooKeeperBackend:
    backend = open_backend(url, prefix="jobfence", socket_timeout=2.0)
    assert isinstance(backend, ZooKeeperBackend)
    lease = backend.try_acquire("payments:42", 5)
    assert lease is not None and lease.fence > 0
    return backend


def _walk(client: KazooClient, path: str) -> Iterator[str]:
    yield path
    for child in client.get_children(path):
        yield from _walk(client, f"{path}/{child}")


def test_the_url_user_info_is_a_percent_decoded_digest_identity() -> None:
    target = parse_target(f"zookeeper://{USER}:{quote(PASSWORD, safe='')}@a:1,b:2/x")
    assert target.auth == (USER, PASSWORD) and target.hosts == "a:1,b:2"
    assert PASSWORD not in repr(target)


def test_with_auth_every_node_is_the_identitys_alone(
    zookeeper_server: ZooKeeperServer, owner: KazooClient, anonymous: KazooClient, chroot: str
) -> None:
    backend = _take_a_lock(_url(zookeeper_server, chroot))
    try:
        assert backend.security() == Security(tls=False, verified=False, hostname_checked=False,
                                               auth=True)  # fmt: skip
        ident = make_digest_acl_credential(USER, PASSWORD)
        nodes = list(_walk(owner, chroot))
        assert f"{chroot}/jobfence/fence-base" in nodes and len(nodes) > 260
        with pytest.raises(NoAuthError):  # nor can anyone else read the keys
            anonymous.get_children(f"{chroot}/jobfence/locks")
        for path in nodes:
            acls, _ = owner.get_acls(path)
            assert [(a.id.scheme, a.id.id, a.perms) for a in acls] == [
                ("digest", ident, Permissions.ALL)
            ], path
    finally:
        backend.close()


def test_an_anonymous_client_cannot_change_the_fence_base_or_a_lock(
    zookeeper_server: ZooKeeperServer, owner: KazooClient, anonymous: KazooClient, chroot: str
) -> None:
    backend = _take_a_lock(_url(zookeeper_server, chroot))
    try:
        base = f"{chroot}/jobfence/fence-base"
        with pytest.raises(NoAuthError):
            anonymous.set_acls(base, OPEN_ACL_UNSAFE)
        with pytest.raises(NoAuthError):
            anonymous.set(base, b"1")
        with pytest.raises(NoAuthError):
            anonymous.delete(base)
        (lock,) = owner.get_children(f"{chroot}/jobfence/locks")
        with pytest.raises(NoAuthError):
            anonymous.delete(f"{chroot}/jobfence/locks/{lock}")
        with pytest.raises(NoAuthError):
            anonymous.create(f"{chroot}/jobfence/locks/intruder")
    finally:
        backend.close()


def test_control_without_auth_the_nodes_are_world_writable(
    zookeeper_server: ZooKeeperServer, anonymous: KazooClient, chroot: str
) -> None:
    """Control: what an anonymous client could do to the nodes before (and still can to
    those of a URL without a user)."""
    backend = _take_a_lock(f"zookeeper://{zookeeper_server.address}{chroot}")
    try:
        assert backend.security() == Security(False, False, False, False)
        base = f"{chroot}/jobfence/fence-base"
        anonymous.set_acls(base, OPEN_ACL_UNSAFE)
        anonymous.set(base, b"1")
    finally:
        backend.close()


def test_a_wrong_password_is_refused_by_name_without_the_secret(
    zookeeper_server: ZooKeeperServer, chroot: str
) -> None:
    _take_a_lock(_url(zookeeper_server, chroot)).close()
    wrong = "not-the-pw-777"
    backend = open_backend(_url(zookeeper_server, chroot, pw=wrong), socket_timeout=2.0)
    try:
        with pytest.raises(LockError) as refused:
            backend.try_acquire("payments:42", 5)
        text = f"{refused.value} {refused.value!r}"
        assert f"to user '{USER}' (NoAuth)" in text
        assert "put the user and password that made them in the lock URL" in text
        assert wrong not in text and PASSWORD not in text
        # The start-up check's hook says so too, as a problem with its fix.
        ((problem, fix),) = backend.server_problems([5.0])
        assert "another identity" in problem and "lock URL" in fix
    finally:
        backend.close()


def test_no_user_against_protected_nodes_is_refused_naming_the_user_info(
    zookeeper_server: ZooKeeperServer, chroot: str
) -> None:
    _take_a_lock(_url(zookeeper_server, chroot)).close()
    backend = open_backend(f"zookeeper://{zookeeper_server.address}{chroot}", socket_timeout=2.0)
    try:
        with pytest.raises(LockError, match="the lock URL names no user"):
            backend.try_acquire("payments:42", 5)
    finally:
        backend.close()


def test_auth_over_world_writable_nodes_warns_to_remake_them(
    zookeeper_server: ZooKeeperServer, chroot: str, caplog: pytest.LogCaptureFixture
) -> None:
    _take_a_lock(f"zookeeper://{zookeeper_server.address}{chroot}").close()
    with caplog.at_level(logging.WARNING, logger="jobfence.locks.backends.zookeeper"):
        _take_a_lock(_url(zookeeper_server, chroot)).close()
    assert "writable by anyone" in caplog.text and PASSWORD not in caplog.text


def test_tls_options_are_kazoos_with_verification_on() -> None:
    target = parse_target("zookeeper://h:2281/x?ca=/ca.pem")
    assert target.tls == {"use_ssl": True, "ca": "/ca.pem", "verify_certs": True,
                          "check_hostname": True}  # fmt: skip
    backend = ZooKeeperBackend.from_url("zookeeper://h:2281?use_ssl=true&check_hostname=false")
    assert backend.security() == Security(tls=True, verified=True, hostname_checked=False,
                                           auth=False)  # fmt: skip
    for bad, message in (
        ("use_ssl=false&ca=/ca.pem", "use_ssl=false with other TLS options"),
        ("verify_certs=false&use_ssl=true&check_hostname=true", "drop verify_certs=false"),
        ("keyfile=/k.pem&use_ssl=1", "keyfile without certfile"),
        ("check_hostname=false", "without TLS"),
        ("timeout=3", "unknown option 'timeout'"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_target(f"zookeeper://h:2281?{bad}")
