"""MySQL/MariaDB TLS and logins on private mariadbd servers with a test CA (what connects),
and a fake server offering no TLS (what is refused before the login)."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymysql  # type: ignore[import-untyped]
import pytest
import sqlalchemy.exc
from pymysql.err import OperationalError  # type: ignore[import-untyped]

from devstack import local_mariadb
from devstack.local_mariadb import MariaDBServer
from devstack.pki import Pki, make_pki
from jobfence.locks import BackendUnavailable, LockError, Security
from jobfence.locks.backends.mysql import MySQLBackend, parse_url
from jobfence.tasks.effects import make_engine
from tests.fake_sql_servers import FakeMySQL

PASSWORD = "jfTLS-pw#s3cret-77"  # the test password: no message may contain it
CERT_PASSWORD = "jfX509-pw#s3cret-88"
IN_URL = PASSWORD.replace("#", "%23")


@dataclass(frozen=True)
class Servers:
    pki: Pki
    good: MariaDBServer  # certificate for localhost / 127.0.0.1
    wrong_name: MariaDBServer  # certificate from the same CA, for wrong.example


def _set_up(server: MariaDBServer) -> None:
    server.admin("CREATE DATABASE jobfence")
    server.admin("CREATE USER 'jf'@'%%' IDENTIFIED BY %s REQUIRE SSL", (PASSWORD,))
    server.admin("CREATE USER 'jfx'@'%%' IDENTIFIED BY %s REQUIRE X509", (CERT_PASSWORD,))
    server.admin("CREATE USER 'plain'@'%%' IDENTIFIED BY %s", (PASSWORD,))
    for user in ("jf", "jfx", "plain"):
        server.admin(f"GRANT ALL ON jobfence.* TO '{user}'@'%'")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    reason = local_mariadb.unavailable()
    if reason is not None:
        pytest.skip(reason)
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    with (
        MariaDBServer(tls=(pki.ca, pki.server_cert, pki.server_key)) as good,
        MariaDBServer(tls=(pki.ca, pki.wrong_name_cert, pki.wrong_name_key)) as wrong_name,
    ):
        _set_up(good)
        _set_up(wrong_name)
        yield Servers(pki, good, wrong_name)


def _url(server: MariaDBServer, query: str = "", *, user: str = "jf", pw: str = PASSWORD,
         host: str = "127.0.0.1") -> str:  # fmt: skip
    pw = pw.replace("#", "%23")
    return f"mysql://{user}:{pw}@{host}:{server.port}/jobfence" + (f"?{query}" if query else "")


def _works(url: str) -> MySQLBackend:
    backend = MySQLBackend.from_url(url, prefix="tls")
    try:
        lease = backend.try_acquire("tls-probe", 5)
        assert lease is not None and lease.fence > 0
        assert lease.release()
        conn = backend._pool.get()
        with conn.cursor() as cur:
            cur.execute("SHOW SESSION STATUS LIKE 'Ssl_version'")
            ((_, version),) = cur.fetchall()
        backend._pool.put(conn)
        assert version.startswith("TLS"), "the session is not encrypted"
    finally:
        backend.close()
    return backend


def _refused(url: str) -> str:
    backend = MySQLBackend.from_url(url, prefix="tls", socket_timeout=2.0)
    try:
        with pytest.raises(BackendUnavailable) as failed:
            backend.try_acquire("tls-probe", 5)
    finally:
        backend.close()
    text = f"{failed.value} {failed.value!r}"
    for secret in (PASSWORD, CERT_PASSWORD, PASSWORD.replace("#", "%23")):
        assert secret not in text
    return str(failed.value)


# --------------------------------------------------------------------------- the right CA


def test_ssl_ca_alone_verifies_chain_and_host_name_and_connects(servers: Servers) -> None:
    backend = _works(_url(servers.good, f"ssl_ca={servers.pki.ca}"))
    assert backend.security() == Security(tls=True, verified=True, hostname_checked=True,
                                           auth=True)  # fmt: skip


def test_the_certificate_names_localhost_too(servers: Servers) -> None:
    _works(_url(servers.good, f"ssl_ca={servers.pki.ca}", host="localhost"))


def test_ssl_mode_verify_identity_is_the_same_as_ssl_ca_alone(servers: Servers) -> None:
    backend = _works(_url(servers.good, f"ssl_mode=VERIFY_IDENTITY&ssl_ca={servers.pki.ca}"))
    assert backend.security().hostname_checked


# --------------------------------------------------------------------------- the wrong CA


def test_a_certificate_from_another_ca_is_refused_naming_ssl_ca(servers: Servers) -> None:
    text = _refused(_url(servers.good, f"ssl_ca={servers.pki.other_ca}"))
    assert "TLS certificate did not verify" in text
    assert "ssl_ca=/path/ca.pem" in text


def test_without_a_ca_file_the_system_cas_do_not_trust_a_private_ca(servers: Servers) -> None:
    text = _refused(_url(servers.good, "ssl_mode=VERIFY_IDENTITY"))
    assert "did not verify" in text and "ssl_ca=" in text


# --------------------------------------------------------------------------- the wrong host name


def test_naive_pymysql_with_ssl_ca_sends_its_login_to_a_wrong_name_certificate(
    servers: Servers,
) -> None:
    """Control: what the old URL handling did with `?ssl_ca=` (PyMySQL's own TLS set-up)
    logs in to a server whose certificate names another host."""
    conn = pymysql.connect(
        host="127.0.0.1", port=servers.wrong_name.port, user="jf", password=PASSWORD,
        database="jobfence", ssl_ca=str(servers.pki.ca),
    )  # fmt: skip
    try:
        assert isinstance(conn._sock, ssl.SSLSocket)
    finally:
        conn.close()


def test_a_certificate_for_another_host_is_refused_naming_the_downgrade(
    servers: Servers,
) -> None:
    text = _refused(_url(servers.wrong_name, f"ssl_ca={servers.pki.ca}"))
    assert "not valid for host '127.0.0.1'" in text
    assert "ssl_verify_identity=false" in text
    text = _refused(_url(servers.wrong_name, f"ssl_ca={servers.pki.ca}&ssl_verify_cert=true"))
    assert "not valid for host" in text


def test_turning_the_host_name_check_off_is_a_visible_downgrade(servers: Servers) -> None:
    for query in ("ssl_verify_identity=false", "ssl_mode=VERIFY_CA"):
        backend = _works(_url(servers.wrong_name, f"ssl_ca={servers.pki.ca}&{query}"))
        assert backend.security() == Security(tls=True, verified=True, hostname_checked=False,
                                               auth=True)  # fmt: skip


def test_encryption_without_verification_is_a_visible_downgrade(servers: Servers) -> None:
    backend = _works(_url(servers.good, "ssl_mode=REQUIRED"))
    assert backend.security() == Security(tls=True, verified=False, hostname_checked=False,
                                           auth=True)  # fmt: skip


# --------------------------------------------------------------------------- logins


def test_a_wrong_password_is_refused_naming_user_and_password(servers: Servers) -> None:
    text = _refused(_url(servers.good, f"ssl_ca={servers.pki.ca}", pw="not-the-password"))
    assert "refused the login of user 'jf'" in text
    assert "check the user and password in the lock URL" in text
    assert "not-the-password" not in text


def test_a_user_that_requires_ssl_is_refused_without_tls(servers: Servers) -> None:
    text = _refused(_url(servers.good, "ssl_mode=DISABLED"))
    assert "refused the login" in text and "REQUIREs X509 or SSL" in text


def test_a_missing_client_certificate_is_refused_naming_ssl_cert(servers: Servers) -> None:
    pki = servers.pki
    text = _refused(_url(servers.good, f"ssl_ca={pki.ca}", user="jfx", pw=CERT_PASSWORD))
    assert "ssl_cert=/path/client.pem&ssl_key=/path/client.key" in text
    backend = _works(_url(
        servers.good, f"ssl_ca={pki.ca}&ssl_cert={pki.client_cert}&ssl_key={pki.client_key}",
        user="jfx", pw=CERT_PASSWORD,
    ))  # fmt: skip
    assert backend.security().auth


def test_tls_asked_of_a_server_without_tls_is_refused(mariadb_url: str) -> None:
    """The shared MariaDB serves no TLS (have_ssl DISABLED): `ssl_ca` must not fall back to
    plain text."""
    with pymysql.connect(host="127.0.0.1", port=3306, user="root") as conn, conn.cursor() as cur:
        cur.execute("SHOW VARIABLES LIKE 'have_ssl'")
        ((_, have_ssl),) = cur.fetchall()
    if have_ssl == "YES":
        pytest.skip("the shared MariaDB serves TLS")
    url = mariadb_url.replace("mysql+pymysql://", "mysql://")
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    text = _refused(f"{url}?ssl_ca={ca}" if ca.exists() else f"{url}?ssl_mode=REQUIRED")
    assert "offers no TLS" in text


# --------------------------------------------------------------------------- URL options


def test_tls_options_come_out_explicit() -> None:
    base = "mysql://u:p@h/db"
    assert "ssl_verify_cert" not in parse_url(base)
    ca = parse_url(f"{base}?ssl_ca=/ca.pem")
    assert (ca["ssl_verify_cert"], ca["ssl_verify_identity"]) == (True, True)
    assert parse_url(f"{base}?ssl_mode=verify_ca")["ssl_verify_identity"] is False
    assert parse_url(f"{base}?ssl_mode=DISABLED") == {**parse_url(base), "ssl_disabled": True}
    assert parse_url(f"{base}?ssl_verify_cert=false") == parse_url(base)  # asks for nothing


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("ssl_mode=PREFERRED", "is not one of VERIFY_IDENTITY"),
        ("ssl_mode=REQUIRED&ssl_verify_identity=false", "spell the TLS mode once"),
        ("ssl_mode=DISABLED&ssl_ca=/ca.pem", "ssl_mode=DISABLED with ssl_ca"),
        ("ssl_verify_identity=true&ssl_verify_cert=false", "drop ssl_verify_cert=false"),
        ("ssl_key=/k.pem", "ssl_key without ssl_cert"),
        ("ssl_verify_identity=maybe", "not true or false"),
        ("ssl_ca=", "is empty"),
        ("sslmode=require", "unknown option 'sslmode'"),
    ],
)
def test_contradictory_or_unknown_tls_options_are_refused(query: str, message: str) -> None:
    with pytest.raises(LockError, match=message) as failed:
        parse_url(f"mysql://u:{IN_URL}@h/db?{query}")
    assert PASSWORD not in str(failed.value) and IN_URL not in str(failed.value)


def test_an_unreadable_ca_file_is_refused_when_the_backend_is_made(tmp_path: Path) -> None:
    with pytest.raises(LockError, match=r"ssl_ca=.* cannot be loaded") as failed:
        MySQLBackend.from_url(f"mysql://u:{IN_URL}@h/db?ssl_ca={tmp_path / 'none.pem'}")
    assert PASSWORD not in str(failed.value) and IN_URL not in str(failed.value)


def test_security_without_tls_says_so() -> None:
    assert MySQLBackend.from_url("mysql://u@h/db").security() == Security(False, False, False,
                                                                           False)  # fmt: skip


def test_the_start_up_hook_reports_a_refused_login_or_certificate_as_a_problem(
    servers: Servers,
) -> None:
    """Not an outage to wait out: `server_problems` (the start-up check's refusal) names it."""
    for url, fix in (
        (_url(servers.good, f"ssl_ca={servers.pki.ca}", pw="not-the-password"),
         "check the user and password"),
        (_url(servers.good, f"ssl_ca={servers.pki.other_ca}"), "ssl_ca=/path/ca.pem"),
        (_url(servers.wrong_name, f"ssl_ca={servers.pki.ca}"), "ssl_verify_identity=false"),
    ):  # fmt: skip
        backend = MySQLBackend.from_url(url, prefix="tls")
        try:
            ((problem, hint),) = backend.server_problems()
        finally:
            backend.close()
        assert problem.startswith("cannot connect to the MySQL lock server") and fix in hint
        assert PASSWORD not in problem + hint and "not-the-password" not in problem + hint
    backend = MySQLBackend.from_url(_url(servers.good, f"ssl_ca={servers.pki.ca}"), prefix="tls")
    try:
        assert backend.server_problems() == []
    finally:
        backend.close()


# --------------------------------------------------------------------------- a server without TLS


@pytest.fixture(params=["installed", "1.1"])
def pymysql_version(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The installed PyMySQL, and PyMySQL 1.1.x's handshake (which the `>=1.1.1` floor let
    in): TLS asked for, a server offering none, it carried on in clear text, where 1.2.0+
    refuses. Emulated on 1.2+ by turning its own refusal off; a no-op on 1.1.x."""
    if request.param == "1.1":
        original = pymysql.connections.Connection._request_authentication

        def carry_on_in_clear(self: Any) -> None:
            self._ssl_required = False
            original(self)

        monkeypatch.setattr(pymysql.connections.Connection, "_request_authentication",
                            carry_on_in_clear)  # fmt: skip
    return str(request.param)


def test_pymysql_1_1_sends_the_password_to_a_server_offering_no_tls() -> None:
    """Control: asked for verified TLS, PyMySQL 1.1's handshake with a server (or a man in
    the middle) that offers none answers its `mysql_clear_password` with the password, and
    the login error that follows reads as a wrong password."""
    original = pymysql.connections.Connection._request_authentication

    class Pymysql11(pymysql.connections.Connection):  # type: ignore[misc]
        def _request_authentication(self) -> None:
            self._ssl_required = False  # 1.1.x had no such check
            original(self)

    with FakeMySQL() as fake:
        with pytest.raises(OperationalError) as failed:
            Pymysql11(host="127.0.0.1", port=fake.port, user="jf", password=PASSWORD,
                      database="jobfence", ssl=ssl.create_default_context(),
                      connect_timeout=5)  # fmt: skip
        fake.served(1)
    assert fake.got(PASSWORD)
    assert failed.value.args[0] == 1045


@pytest.mark.parametrize("query", ["ssl_mode=VERIFY_IDENTITY", "ssl_mode=REQUIRED",
                                   "ssl_verify_cert=true"])  # fmt: skip
def test_the_lock_backend_refuses_a_server_offering_no_tls_before_the_login(
    pymysql_version: str, query: str
) -> None:
    with FakeMySQL() as fake:
        text = _refused(f"mysql://jf:{IN_URL}@127.0.0.1:{fake.port}/jobfence?{query}")
        fake.served(1)
    assert fake.received == [b""], "the client sent something: not even a user name may go"
    assert "offers no TLS" in text and "refused before sending the login" in text
    assert "ssl_mode" in text and "check the user and password" not in text


@pytest.mark.parametrize("query", ["ssl_mode=VERIFY_IDENTITY", "ssl_verify_cert=true",
                                   "ssl_capath={tmp}", "ssl_ca={tmp}/ca.pem"])  # fmt: skip
def test_a_mysql_database_url_refuses_a_server_offering_no_tls_before_the_login(
    pymysql_version: str, query: str, tmp_path: Path
) -> None:
    """The effects database (JOBFENCE_DATABASE_URL, SQLAlchemy's mysql+pymysql://) reads
    its TLS options as the lock URL does, `ssl_mode` included, and refuses the same way."""
    servers_ca = make_pki(tmp_path).ca if "ca.pem" in query else None
    query = query.format(tmp=tmp_path).replace(f"{tmp_path}/ca.pem", str(servers_ca))
    with FakeMySQL() as fake:
        engine = make_engine(f"mysql+pymysql://jf:{IN_URL}@127.0.0.1:{fake.port}/jobfence?{query}")
        try:
            with pytest.raises(sqlalchemy.exc.OperationalError) as failed:
                engine.connect()
        finally:
            engine.dispose()
        fake.served(1)
    assert fake.received == [b""]
    text = str(failed.value)
    assert "offers no TLS" in text and "refused before sending the login" in text
    assert PASSWORD not in text and IN_URL not in text


def test_a_mysql_database_url_without_tls_options_still_connects(mariadb_url: str) -> None:
    engine = make_engine(mariadb_url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    finally:
        engine.dispose()


def test_contradictory_tls_options_in_a_database_url_are_refused_naming_it() -> None:
    engine = make_engine(f"mysql+pymysql://jf:{IN_URL}@127.0.0.1:1/db?ssl_mode=PREFERRED")
    with pytest.raises(LockError, match=r"ssl_mode='PREFERRED' in the database URL "
                       r"\(JOBFENCE_DATABASE_URL\) is not one of") as failed:  # fmt: skip
        engine.connect()
    assert PASSWORD not in str(failed.value) and IN_URL not in str(failed.value)
