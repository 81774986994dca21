"""TLS and passwords for Redlock, Redis Cluster and Sentinel on private servers with a test CA."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devstack.local_cluster import LocalCluster
from devstack.local_sentinel import LocalSentinel
from devstack.pki import Pki, make_pki, tls_query
from devstack.redis_masters import RedisMasters
from devstack.redis_server import RedisServer
from jobfence.config.errors import UnsafeSettings
from jobfence.config.urls import cluster_target, redlock_masters, sentinel_target
from jobfence.locks import BackendUnavailable
from jobfence.locks.aio import AsyncLocker
from jobfence.locks.backend import LockBackend, Security
from jobfence.locks.backends.redis.cluster import RedisClusterBackend
from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend
from jobfence.locks.backends.redlock import RedlockBackend

# Characters a URL must percent-encode, in both passwords: the tests also check the URLs.
PASSWORD = "Fam1ly#TLS-pw"
SENTINEL_PASSWORD = "Sent?nel-pw42"
SECRETS = (PASSWORD, SENTINEL_PASSWORD, "wrong-Pw-77")
# A refusal comes at once on an idle machine; the budget is for a loaded one (CI with four
# test workers), where three TLS handshakes and a TLS 1.3 alert took over 3 s.
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class Family:
    """One TLS topology: its URL (right CA, client certificate, passwords), its servers
    (whose certificate a test may swap), and how to open a backend on a URL."""

    name: str
    url: str
    servers: list[RedisServer]
    open: Callable[[str], LockBackend]


def _redlock(pki: Pki) -> Iterator[Family]:
    with RedisMasters(3, tls=pki, password=PASSWORD) as masters:
        yield Family("redlock", masters.url, masters.servers,
                     lambda u: RedlockBackend.from_url(u, socket_timeout=TIMEOUT))  # fmt: skip


def _cluster(pki: Pki) -> Iterator[Family]:
    with LocalCluster(3, tls=pki, password=PASSWORD) as cluster:
        yield Family("cluster", cluster.url, cluster.servers,
                     lambda u: RedisClusterBackend.from_url(u, socket_timeout=TIMEOUT))  # fmt: skip


def _sentinel(pki: Pki) -> Iterator[Family]:
    topology = LocalSentinel(replicas=1, sentinels=2, tls=pki, password=PASSWORD,
                             sentinel_password=SENTINEL_PASSWORD)  # fmt: skip
    with topology:
        yield Family("sentinel", topology.url, topology.nodes,
                     lambda u: RedisSentinelBackend.from_url(u, socket_timeout=TIMEOUT))


@pytest.fixture(scope="module", params=["redlock", "cluster", "sentinel"])
def family(request: pytest.FixtureRequest, pki: Pki) -> Iterator[Family]:
    start = {"redlock": _redlock, "cluster": _cluster, "sentinel": _sentinel}[request.param]
    yield from start(pki)


def _with_query(family: Family, query: str) -> str:
    base, _, rest = family.url.partition("?")
    extra = "&".join(p for p in rest.split("&") if p.startswith("sentinel_password="))
    return f"{base}?{query}" + (f"&{extra}" if extra else "")


def _refusal(family: Family, url: str) -> str:
    """The error text of a lock attempt on `url` (it must fail), checked for secrets."""
    backend = None
    try:
        with pytest.raises(BackendUnavailable) as failed:
            backend = family.open(url)
            backend.try_acquire("tls-probe", 30)  # redlock waits min(TIMEOUT, ttl)
    finally:
        if backend is not None:
            backend.close()
    text = f"{failed.value} {failed.value.__cause__!r}"
    for secret in SECRETS:
        assert secret not in text, "a password in an error"
    return text


def test_the_right_ca_client_certificate_and_password_take_locks_with_rising_fences(
    family: Family,
) -> None:
    scheme = family.url.split("://")[0]
    assert scheme in ("redlocks", "rediss+cluster", "rediss+sentinel")
    backend = family.open(family.url)
    try:
        assert backend.security() == Security(tls=True, verified=True, hostname_checked=True,
                                              auth=True)  # fmt: skip
        first = backend.try_acquire("tls-job", 5)
        assert first is not None
        first.extend()
        assert first.release()
        second = backend.try_acquire("tls-job", 5)
        assert second is not None and second.fence > first.fence
        assert second.release()
    finally:
        backend.close()

    async def run() -> int:
        locker = AsyncLocker.from_url(family.url, socket_timeout=TIMEOUT)
        try:
            async with locker.lock("tls-job", ttl=5) as lease:
                return lease.fence
        finally:
            await locker.aclose()

    assert asyncio.run(run()) > second.fence  # the asyncio store over TLS too


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong CA", "did not verify"),
        ("no client certificate", "client certificate"),
        ("wrong password", "refused the login"),
    ],
)
def test_a_wrong_ca_missing_certificate_or_password_is_refused_naming_the_fix(
    family: Family, pki: Pki, case: str, expected: str
) -> None:
    if case == "wrong CA":
        url = _with_query(family, tls_query(pki, ca=pki.other_ca))
    elif case == "no client certificate":
        url = _with_query(family, tls_query(pki, client_cert=False))
    else:
        url = family.url.replace("Fam1ly%23TLS-pw", "wrong-Pw-77")
        assert url != family.url
    text = _refusal(family, url)
    assert expected in text, text
    # The fix names the URL option to change.
    assert any(o in text for o in ("ssl_ca_certs=", "ssl_certfile=", "password")), text


def test_the_sentinels_own_password_is_separate_and_refused_naming_it(pki: Pki) -> None:
    topology = LocalSentinel(replicas=0, sentinels=1, tls=pki, password=PASSWORD,
                             sentinel_password=SENTINEL_PASSWORD)  # fmt: skip
    with topology:
        family = Family("sentinel", topology.url, topology.nodes,
                        lambda u: RedisSentinelBackend.from_url(u, socket_timeout=TIMEOUT))
        assert f"sentinel_password={SENTINEL_PASSWORD.replace('?', '%3F')}" in family.url
        for url in (family.url.replace("%3F", "x"),  # a wrong one
                    family.url.split("&sentinel_password=")[0]):  # none at all
            text = _refusal(family, url)
            assert "the sentinels" in text and "sentinel_password=" in text, text


def test_a_certificate_for_another_host_name_is_refused(family: Family, pki: Pki) -> None:
    @contextlib.contextmanager
    def certificate(cert: Path, key: Path) -> Iterator[None]:
        for server in family.servers:
            admin: Any = server.client()
            admin.execute_command("CONFIG", "SET", "tls-cert-file", str(cert),
                                  "tls-key-file", str(key))  # fmt: skip
        try:
            yield
        finally:
            for server in family.servers:
                restore: Any = server.client()
                restore.execute_command(
                    "CONFIG", "SET", "tls-cert-file", str(pki.server_cert),
                    "tls-key-file", str(pki.server_key),
                )

    with certificate(pki.wrong_name_cert, pki.wrong_name_key):
        text = _refusal(family, family.url)
    assert "does not name the host" in text and "ssl_check_hostname=false" in text, text


def test_ssl_check_hostname_false_is_a_downgrade_security_reports(pki: Pki) -> None:
    base = f"redlocks://:pw@127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?ssl_ca_certs={pki.ca}"
    checked = RedlockBackend.from_url(base)
    unchecked = RedlockBackend.from_url(base + "&ssl_check_hostname=false")
    unverified = RedlockBackend.from_url(base + "&ssl_cert_reqs=none")
    plain = RedlockBackend.from_url("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    try:
        assert checked.security() == Security(True, True, True, True)
        assert unchecked.security() == Security(True, True, False, True)
        assert unverified.security() == Security(True, False, False, True)
        assert plain.security() == Security(False, False, False, False)
        # The check is set on every socket's context, whatever redis-py's default.
        ctx = checked.masters[0].ssl_context
        assert ctx is not None and ctx.check_hostname
        assert checked.masters[0].client.connection_pool.connection_kwargs[
            "ssl_check_hostname"] is True
    finally:
        for backend in (checked, unchecked, unverified, plain):
            backend.close()
    sentinel = RedisSentinelBackend.from_url(
        f"rediss+sentinel://:pw@127.0.0.1:1/m?ssl_ca_certs={pki.ca}&ssl_check_hostname=false"
    )
    try:
        assert sentinel.security() == Security(True, True, False, True)
    finally:
        sentinel.close()


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redlock://a:1,b:2,c:3?ssl_ca_certs=/ca.pem", "redlock:// is plain TCP"),
        ("redis+cluster://a:1?ssl_certfile=/c.pem", "use rediss+cluster://"),
        ("redis+sentinel://a:1/m?ssl_ca_certs=/ca.pem", "use rediss+sentinel://"),
        ("redlocks://a:1,b:2,c:3?ssl_cert_reqs=maybe", "ssl_cert_reqs='maybe'"),
        ("rediss+cluster://a:1?ssl_check_hostname=perhaps", "ssl_check_hostname='perhaps'"),
        ("rediss+sentinel://a:1/m?ssl_keyfile=/k.pem", "ssl_keyfile= without ssl_certfile="),
        ("redlocks://a:1,b:2,c:3?ssl_cert_reqs=none&ssl_check_hostname=true",
         "cannot be checked"),
        ("rediss+sentinel://:pw@a:1/m?sentinel_password=sp&sentinel_user=u", "sentinel_user"),
    ],
)
def test_bad_tls_options_are_refused_naming_the_option_and_no_password(
    url: str, problem: str
) -> None:
    parse: Callable[[str], Any] = (
        redlock_masters if url.startswith("redlock") else
        cluster_target if "cluster" in url else sentinel_target
    )  # fmt: skip
    with pytest.raises(UnsafeSettings) as refused:
        parse(url)
    text = str(refused.value)
    assert "JOBFENCE_LOCK_URL" in text and problem in text, text
    assert "sp&" not in text and ":pw@" not in text


def test_the_tls_spellings_parse_into_one_set_of_options(pki: Pki) -> None:
    query = f"ssl_ca_certs={pki.ca}&ssl_certfile={pki.client_cert}&ssl_keyfile={pki.client_key}"
    target = sentinel_target(f"rediss+sentinel://u:p@h:1/m?{query}&sentinel_password=s%3Fp")
    cluster = cluster_target(f"rediss+cluster://u:p@h:1?{query}")
    assert target.tls == cluster.tls and target.tls.hostname_checked
    assert target.sentinel_password == "s?p" and "s?p" not in repr(target)
    masters = redlock_masters(f"redlocks://u:p@h:1,h:2,h:3/2?{query}")
    assert all(m.startswith("rediss://u:p@h:") and "/2?" in m for m in masters)
    assert "ssl_check_hostname=true" in masters[0]
