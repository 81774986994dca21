"""A rediss:// broker and result backend verify the server before the login (real TLS redis)."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from devstack.pki import Pki, make_pki
from devstack.redis_server import RedisServer, free_port
from jobfence.config import Settings, load_settings
from jobfence.config.security import is_loopback
from jobfence.worker import setup as jobfence_setup
from jobfence.worker.app import create_app
from jobfence.worker.checks import check_broker, check_security, posture_lines

REPO_ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "Br0ker#TLS-pw"
STRONG = "k7Vq2-strong-random-secret-for-tests-0123456789"
TIMEOUT = 2.0


class TlsBroker:
    """A private redis-server with a password, serving TLS with `pki`'s certificate (for
    localhost and 127.0.0.1) and no client certificate asked; the plain port is the
    harness's, whose one connection counts the logins the server received."""

    def __init__(self, server: RedisServer, tls_port: int) -> None:
        self.server, self.tls_port = server, tls_port
        self.harness = server.client()
        self.harness.ping()  # its own login, before any count

    def url(self, host: str = "127.0.0.1", db: int = 1, query: str = "") -> str:
        pw = PASSWORD.replace("#", "%23")
        return f"rediss://:{pw}@{host}:{self.tls_port}/{db}" + (f"?{query}" if query else "")

    def logins(self) -> int:
        """AUTH and HELLO commands received so far (the harness's own connection is reused)."""
        stats = self.harness.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("auth", "hello"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def broker(pki: Pki) -> Iterator[TlsBroker]:
    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-cert-file", str(pki.server_cert),
            "--tls-key-file", str(pki.server_key), "--tls-ca-cert-file", str(pki.ca),
            "--tls-auth-clients", "no"]  # fmt: skip
    with RedisServer(extra_args=args, password=PASSWORD) as server:
        yield TlsBroker(server, tls_port)


def _other_name() -> str:
    """A name of this host that is no loopback literal and not in the certificate: judged
    another host, as a man in the middle's would be (it resolves to 127.0.0.1 here)."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        pytest.skip(f"this host's name {name!r} does not resolve")
    if is_loopback(name) or address != "127.0.0.1":
        pytest.skip(f"this host's name {name!r} is a loopback literal or not 127.0.0.1")
    return name


def _settings(**values: Any) -> Settings:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_settings(**{"key_secret": STRONG, **values})


def _connect(app: Celery) -> None:
    """Open the app's broker connection as a worker or publisher does (kombu pings it)."""
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
        conn.default_channel.client.ping()


def _users_app(url: str, **conf: Any) -> Celery:
    app = Celery("users-app", set_as_current=False)
    app.conf.update(broker_url=url, broker_connection_timeout=TIMEOUT, **conf)
    return app


# --------------------------------------------------------------------------- the broker


@pytest.mark.parametrize("host", ["127.0.0.1", "other-name"])
def test_a_rediss_broker_never_sends_the_password_to_an_untrusted_server(
    broker: TlsBroker, host: str
) -> None:
    host = _other_name() if host == "other-name" else host
    url = broker.url(host)  # no ssl_ options: the server's CA is no CA this host trusts
    # Control: Celery and kombu as configured before (no broker_use_ssl) connect with no
    # certificate check, and the server is sent the password.
    before = broker.logins()
    _connect(_users_app(url))
    assert broker.logins() > before, "the old way did not log in: the control proves nothing"
    # jobfence.setup gives the broker verified TLS: refused in the handshake, no login.
    app = _users_app(url)
    jobfence_setup.setup(app, _settings(lock_url="memory://"))
    before = broker.logins()
    with pytest.raises(Exception, match=r"(?i)certificate verify failed"):
        _connect(app)
    assert broker.logins() == before, "the untrusted server got a login"
    assert app.conf.broker_use_ssl["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert app.conf.broker_use_ssl["ssl_check_hostname"] is True


def test_the_bundled_apps_broker_derived_from_a_rediss_lock_url_is_verified(
    broker: TlsBroker, pki: Pki
) -> None:
    lock_url = broker.url(db=0)  # a bare rediss:// lock URL: its broker is database 1
    app = create_app(_settings(lock_url=lock_url), include=[])
    assert app.conf.broker_url.startswith("rediss://")
    before = broker.logins()
    with pytest.raises(Exception, match=r"(?i)certificate verify failed"):
        _connect(app)
    assert broker.logins() == before
    for key in ("broker_use_ssl", "redis_backend_use_ssl"):
        assert app.conf[key]["ssl_cert_reqs"] == ssl.CERT_REQUIRED, key
    # Control: the same broker URL without the settings jobfence fills in logs in.
    _connect(_users_app(app.conf.broker_url))
    assert broker.logins() > before


def test_the_right_ca_works_and_a_wrong_host_name_is_refused(broker: TlsBroker, pki: Pki) -> None:
    # The CA in broker_use_ssl (the URL left bare), as an app may give it.
    app = _users_app(broker.url("localhost"))
    app.conf.broker_use_ssl = {"ssl_ca_certs": str(pki.ca)}
    jobfence_setup.setup(app, _settings(lock_url="memory://"))
    _connect(app)
    # The CA in the URL: jobfence fills in the same for broker and result backend.
    url = broker.url(query=f"ssl_ca_certs={pki.ca}")
    app = _users_app(url, result_backend=broker.url(db=2, query=f"ssl_ca_certs={pki.ca}"))
    jobfence_setup.setup(app, _settings(lock_url="memory://"))
    assert app.conf.broker_use_ssl == app.conf.redis_backend_use_ssl == {
        "ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_check_hostname": True,
        "ssl_ca_certs": str(pki.ca),
    }  # fmt: skip
    _connect(app)
    assert app.backend.client.ping()
    app.backend.client.close()
    # The right CA, a name the certificate does not list: refused before the login.
    wrong = _users_app(broker.url(_other_name(), query=f"ssl_ca_certs={pki.ca}"))
    jobfence_setup.setup(wrong, _settings(lock_url="memory://"))
    before = broker.logins()
    with pytest.raises(Exception, match=r"(?i)hostname mismatch|doesn't match|not valid for"):
        _connect(wrong)
    assert broker.logins() == before


# --------------------------------------------------------------------------- result backend


def test_a_rediss_result_backend_is_verified(broker: TlsBroker, pki: Pki) -> None:
    bare = broker.url(db=2)
    # Control: Celery's own options for the result backend need ssl_cert_reqs; `none`, the
    # value its error message offers, logs in to the untrusted server.
    control = _users_app("memory://", result_backend=f"{bare}?ssl_cert_reqs=none")
    before = broker.logins()
    assert control.backend.client.ping()
    control.backend.client.close()
    assert broker.logins() > before
    # Set up by jobfence, the bare URL gets the verified options: refused, no login.
    app = _users_app("memory://", result_backend=bare)
    jobfence_setup.setup(app, _settings(lock_url="memory://"))
    before = broker.logins()
    with pytest.raises(Exception, match=r"(?i)certificate verify failed"):
        app.backend.client.ping()
    assert broker.logins() == before


# --------------------------------------------------------------------------- start-up check


def _runtime(lock_url: str, **values: Any) -> Any:
    return SimpleNamespace(settings=_settings(lock_url=lock_url, socket_timeout=TIMEOUT, **values),
                           backend=None)  # fmt: skip


def test_the_start_up_broker_check_refuses_a_certificate_that_does_not_verify(
    broker: TlsBroker, pki: Pki
) -> None:
    # The app's own CA, a CA that did not sign the server's certificate.
    app = _users_app(broker.url())
    app.conf.broker_use_ssl = {"ssl_ca_certs": str(pki.other_ca)}
    jobfence_setup.setup(app, _settings(lock_url="memory://"))
    before = broker.logins()
    (finding,) = check_broker(app.conf, _runtime("memory://"))
    assert finding.refuse and finding.setting == "broker_url", finding
    assert "did not verify" in finding.fix and "ssl_ca_certs=" in finding.fix
    assert PASSWORD not in str(finding) and broker.logins() == before
    # The right CA: the check connects with the app's own TLS options and passes.
    app.conf.broker_use_ssl = {"ssl_ca_certs": str(pki.ca)}
    assert list(check_broker(app.conf, _runtime("memory://"))) == []
    assert broker.logins() > before


def _without_jobfence_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("JOBFENCE_", "CELERY_", "DJANGO_"))}  # fmt: skip


def test_a_real_worker_refuses_an_untrusted_rediss_broker(
    broker: TlsBroker, fresh_redis: RedisServer
) -> None:
    env = {**_without_jobfence_variables(), "JOBFENCE_LOCK_URL": fresh_redis.url,
           "JOBFENCE_BROKER_URL": broker.url(), "JOBFENCE_KEY_SECRET": STRONG,
           "JOBFENCE_SOCKET_TIMEOUT": str(TIMEOUT)}  # fmt: skip
    args = [sys.executable, "-m", "celery", "-A", "demo.app", "worker",
            "--pool", "solo"]  # fmt: skip
    before = broker.logins()
    try:
        done = subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the worker started on a broker whose certificate it never verified")
    output = done.stdout + done.stderr
    assert done.returncode == 78, output
    assert "JOBFENCE_BROKER_URL" in output and "did not verify" in output, output
    assert PASSWORD not in output
    assert broker.logins() == before, "the worker logged in to the untrusted broker"


# --------------------------------------------------------------------------- downgrades


def _refused(conf: Any, **values: Any) -> list[Any]:
    return [f for f in check_security(conf, _runtime("memory://", **values)) if f.refuse]


@pytest.mark.parametrize("key", ["broker_use_ssl", "redis_backend_use_ssl"])
@pytest.mark.parametrize("cert_reqs", [ssl.CERT_NONE, ssl.CERT_OPTIONAL, "none"])
def test_an_explicit_unverified_broker_or_backend_is_a_downgrade(key: str, cert_reqs: Any) -> None:
    url = f"rediss://:{PASSWORD.replace('#', '%23')}@broker.example:6380/1"
    url_key = "broker_url" if key == "broker_use_ssl" else "result_backend"
    app = _users_app("memory://")
    app.conf.update({url_key: url, key: {"ssl_cert_reqs": cert_reqs}})
    jobfence_setup.setup(app, _settings(lock_url="memory://"))
    assert app.conf[key] == {"ssl_cert_reqs": cert_reqs}  # the app's own, kept and judged
    (finding,) = _refused(app.conf)
    assert finding.setting == url_key
    assert "TLS unverified" in finding.problem
    assert "JOBFENCE_ALLOW_INSECURE=unverified-tls" in finding.fix
    assert PASSWORD not in str(finding)
    lines = posture_lines(app.conf, _settings(lock_url="memory://"))
    assert any(line.startswith(url_key) and "TLS unverified" in line for line in lines), lines
    # Allowed on purpose: a warning, not a refusal.
    assert _refused(app.conf, allow_insecure="unverified-tls") == []
    warned = list(check_security(app.conf, _runtime("memory://", allow_insecure="unverified-tls")))
    assert [f.setting for f in warned] == [url_key]


def test_no_broker_use_ssl_counts_as_unverified_and_a_verified_one_passes() -> None:
    url = "rediss://:pw-1234@broker.example:6380/1"
    (finding,) = _refused(_DictConf(broker_url=url))  # no broker_use_ssl: kombu's CERT_NONE
    assert "no broker_use_ssl" in finding.problem
    assert _refused(_DictConf(broker_url=url, broker_use_ssl={"ssl_ca_certs": "/ca.pem"})) == []
    # broker_use_ssl=True is no dict of options: kombu speaks plain TCP, the password in clear.
    (finding,) = _refused(_DictConf(broker_url=url, broker_use_ssl=True))
    assert "JOBFENCE_ALLOW_INSECURE=cleartext" in finding.fix
    # A loopback broker is judged as every loopback URL is: TLS there is not required.
    assert _refused(_DictConf(broker_url="rediss://:pw-1234@127.0.0.1:6380/1")) == []


class _DictConf(dict[str, Any]):
    """A Celery configuration's shape for the checks: attributes and get()."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)
