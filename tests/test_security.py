"""Security at start-up: downgrades refused unless allowed, one redaction, escaped CLI output,
signed messages accepted, the metrics endpoint's address/auth/TLS; no test password ever shown."""

from __future__ import annotations

import base64
import datetime
import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from devstack.redis_server import RedisServer, free_port
from jobfence.config import Settings, UnsafeSettings, load_settings, redact
from jobfence.config.errors import EX_CONFIG
from jobfence.config.security import is_loopback, url_posture
from jobfence.config.settings import InsecureSettingsWarning
from jobfence.locks import BackendUnavailable, OwnerMeta, RedisBackend, open_backend
from jobfence.tasks import Runtime
from jobfence.worker.checks import check_lock_backend, check_security, check_serializers
from tests.fake_sql_servers import FakePostgres

REPO_ROOT = Path(__file__).resolve().parents[1]
STRONG = "k7Vq2-strong-random-secret-for-tests-0123456789"
# Every password these tests put in a URL: none may appear in any output they collect.
PASSWORDS = ("pa?ssWORDx", "PWsecretXYZ", "WRONGpwXYZ", "RIGHTpw#42x", "MetricsPW77", "CLEARpw123")
SEEN: list[str] = []


def shown(text: str) -> str:
    """Record `text` (an error, a warning, CLI output) for the final leak check, and check it."""
    SEEN.append(text)
    for password in PASSWORDS:
        assert password not in text, f"a test password is shown: {text!r}"
    return text


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "jobfence", *args],
        env={**os.environ, **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    shown(done.stdout + done.stderr)
    return done


def findings(settings: Settings, conf: Any = None) -> list[Any]:
    conf = conf or SimpleNamespace(broker_url=None, result_backend=None)
    runtime: Any = SimpleNamespace(settings=settings)
    found = list(check_security(conf, runtime))
    for f in found:
        shown(str(f))
    return found


def quiet_settings(**values: Any) -> Settings:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = load_settings(**values)
    for w in caught:
        shown(str(w.message))
    return s


# --------------------------------------------------------------------------- redaction


@pytest.mark.parametrize("field", ["lock_url", "broker_url", "result_backend", "database_url"])
def test_a_password_with_an_unencoded_question_mark_is_never_printed(field: str) -> None:
    url = "redis://:pa?ssWORDx@127.0.0.1:6379/0"
    if field == "database_url":
        url = "postgresql://jf:pa?ssWORDx@127.0.0.1:5432/shop"
    with pytest.raises(UnsafeSettings) as refused:
        load_settings(**{field: url})
    text = shown(str(refused.value))
    assert "'?'" in text and "%3F" in text  # says what is wrong and how to write it


@pytest.mark.parametrize(
    "url",
    [
        "redlock://:pa?ssWORDx@127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
        "redis+sentinel://:pa?ssWORDx@127.0.0.1:26379/mymaster/0",
        "redis+cluster://:pa?ssWORDx@127.0.0.1:7000,127.0.0.1:7001",
        "etcd://127.0.0.1:2379/?password=PWsecretXYZ",
    ],
)
def test_backend_errors_never_print_a_malformed_password(url: str) -> None:
    with pytest.raises((UnsafeSettings, ValueError)) as refused:
        open_backend(url)
    shown(str(refused.value))
    with pytest.raises(UnsafeSettings) as refused_settings:
        load_settings(lock_url=url)
    shown(str(refused_settings.value))


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://:pa?ssWORDx@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://user:pa?ss=1/0@h:1/0", "redis://user:***@h:1/0"),
        ("redis://u:p/a?ss@host/0", "redis://u:***@host/0"),
        ("etcd://h:2379/?password=PWsecretXYZ", "etcd://h:2379/?password=***"),
        ("redis://h/0?ssl_ca_certs=/ca.pem&api_token=PWsecretXYZ",
         "redis://h/0?ssl_ca_certs=/ca.pem&api_token=***"),
        ("redis://h/0?user=a@b.example", "redis://h/0?user=a@b.example"),  # a sound URL
    ],
)
def test_redact_hides_what_lies_between_the_scheme_and_the_last_at(url: str, expected: str) -> None:
    assert shown(redact(url)) == expected


def test_check_never_prints_a_malformed_lock_password() -> None:
    done = run_cli("check", env={"JOBFENCE_LOCK_URL": "redis://:pa?ssWORDx@127.0.0.1:6379/0"})
    assert done.returncode == EX_CONFIG and "JOBFENCE_LOCK_URL" in done.stderr


# --------------------------------------------------------------------------- downgrades


def _items(found: list[Any], refuse: bool = True) -> list[str]:
    return [f.setting for f in found if f.refuse is refuse]


@pytest.mark.parametrize(
    ("url", "item"),
    [
        ("rediss://:PWsecretXYZ@10.1.2.3:6380/0?ssl_cert_reqs=none", "unverified-tls"),
        ("rediss://:PWsecretXYZ@10.1.2.3:6380/0?ssl_check_hostname=false", "unverified-tls"),
        ("postgresql://jf:PWsecretXYZ@10.1.2.3:5432/jobfence?sslmode=require", "unverified-tls"),
        ("postgresql://jf:PWsecretXYZ@10.1.2.3:5432/jobfence", "unverified-tls"),  # prefer
        ("postgresql://jf:CLEARpw123@10.1.2.3:5432/jobfence?sslmode=disable", "cleartext"),
        ("redis://:CLEARpw123@10.1.2.3:6379/0", "cleartext"),
        ("redis://10.1.2.3:6379/0", "no-auth"),
        ("rediss://db.internal:6380/0", "no-auth"),
        ("redlock://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379", "no-auth"),
    ],
)
def test_each_downgrade_is_refused_at_start_up_unless_allowed(url: str, item: str) -> None:
    with pytest.warns(InsecureSettingsWarning) as caught:  # the library user is told too
        settings = load_settings(lock_url=url, key_secret=STRONG)
    assert any("JOBFENCE_ALLOW_INSECURE" in shown(str(w.message)) for w in caught)
    found = findings(settings)
    refused = [f for f in found if f.refuse]
    assert refused and all(f.setting == "JOBFENCE_LOCK_URL" for f in refused)
    assert any(f"JOBFENCE_ALLOW_INSECURE={item}" in f.fix for f in refused)
    # The documented override: the same finding, now a warning that names what allows it.
    allowed = quiet_settings(lock_url=url, key_secret=STRONG,
                             allow_insecure="unverified-tls,cleartext,no-auth")  # fmt: skip
    found = findings(allowed)
    assert not _items(found) and any(f"JOBFENCE_ALLOW_INSECURE={item}" in str(f) for f in found)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://127.0.0.1:6380/0?ssl_cert_reqs=none",  # loopback: no one in between
        "rediss://:PWsecretXYZ@10.1.2.3:6380/0?ssl_ca_certs=/etc/ca.pem",
        "rediss://10.1.2.3:6380/0?ssl_certfile=/c.pem&ssl_keyfile=/k.pem",
        "postgresql://jf:PWsecretXYZ@10.1.2.3:5432/jobfence?sslmode=verify-full",
        "unix:///run/redis.sock",
        "memory://",
    ],
)
def test_verified_and_local_setups_pass(url: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings = load_settings(lock_url=url, key_secret=STRONG)
    assert findings(settings) == []


def test_the_lock_backends_own_account_of_its_connection_wins_over_the_url() -> None:
    """A backend's `security()` (tls, verified, hostname_checked, auth) knows its client's
    defaults: MySQL's `?ssl_ca=` alone is verify-identity in jobfence, say."""
    settings = quiet_settings(lock_url="mysql://jf:PWsecretXYZ@10.1.2.3:3306/jobfence?ssl_ca=/ca.pem",
                              key_secret=STRONG)  # fmt: skip

    def runtime(**sec: bool) -> Any:
        return SimpleNamespace(settings=settings, backend=SimpleNamespace(
            security=lambda: SimpleNamespace(**sec)))  # fmt: skip

    conf = SimpleNamespace(broker_url=None, result_backend=None)
    verified = runtime(tls=True, verified=True, hostname_checked=True, auth=True)
    assert list(check_security(conf, verified)) == []
    chain_only = runtime(tls=True, verified=True, hostname_checked=False, auth=True)
    found = list(check_security(conf, chain_only))
    assert [f.refuse for f in found] == [True] and "host name" in found[0].problem
    plain = runtime(tls=False, verified=False, hostname_checked=False, auth=True)
    found = list(check_security(conf, plain))
    assert any("without TLS" in f.problem for f in found)


def test_the_app_broker_and_result_backend_are_judged_too() -> None:
    settings = quiet_settings(lock_url="redis://127.0.0.1:6379/0", key_secret=STRONG)
    conf = SimpleNamespace(broker_url="amqp://app:CLEARpw123@mq.internal:5672//",
                           result_backend="redis://10.1.2.3:6379/2")  # fmt: skip
    assert _items(findings(settings, conf)) == ["broker_url", "result_backend"]


@pytest.mark.parametrize("secret", ["a", "x" * 31, "password"])
def test_a_short_key_secret_is_refused_at_start_up(secret: str) -> None:
    found = findings(quiet_settings(lock_url="redis://127.0.0.1:6379/0", key_secret=secret))
    assert _items(found) == ["JOBFENCE_KEY_SECRET"]
    assert "32" in found[0].problem
    allowed = quiet_settings(lock_url="redis://127.0.0.1:6379/0", key_secret=secret,
                             allow_insecure="weak-key-secret")  # fmt: skip
    assert not _items(findings(allowed))


def test_an_empty_key_secret_is_refused_by_the_settings() -> None:
    with pytest.raises(UnsafeSettings, match="JOBFENCE_KEY_SECRET"):
        load_settings(key_secret="")


def test_the_public_default_secret_is_refused_with_a_lock_server_elsewhere() -> None:
    local = quiet_settings(lock_url="redis://127.0.0.1:6379/0")
    assert findings(local) == []  # a laptop, tests: loopback only
    remote = quiet_settings(lock_url="rediss://:PWsecretXYZ@10.1.2.3:6380/0")
    found = findings(remote)
    assert _items(found) == ["JOBFENCE_KEY_SECRET"] and "default" in found[0].problem


def test_an_unknown_allow_item_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(UnsafeSettings) as refused:
        load_settings(allow_insecure="cleartext,everything")
    assert "everything" in str(refused.value) and "unverified-tls" in str(refused.value)


@pytest.mark.parametrize(
    "query", ["socket_timeout=300", "socket_connect_timeout=300", "socket_timeout=abc"]
)
def test_a_url_timeout_cannot_undo_the_checked_socket_timeout(query: str) -> None:
    with pytest.raises(UnsafeSettings) as refused:
        load_settings(lock_url=f"redis://127.0.0.1:6379/0?{query}", socket_timeout=2)
    text = shown(str(refused.value))
    assert "JOBFENCE_LOCK_URL" in text and "JOBFENCE_SOCKET_TIMEOUT" in text
    assert query.split("=")[0] in text
    ok = load_settings(lock_url="redis://127.0.0.1:6379/0?socket_timeout=1.5")
    assert ok.lock_url.endswith("socket_timeout=1.5")


def test_check_lists_the_security_posture_and_refuses_a_weak_secret(redis_url: str) -> None:
    env = {"JOBFENCE_LOCK_URL": redis_url, "JOBFENCE_KEY_SECRET": "short-secret"}
    done = run_cli("check", env=env)
    assert done.returncode == EX_CONFIG, done.stdout + done.stderr
    assert "security posture:" in done.stdout
    assert "JOBFENCE_LOCK_URL redis://127.0.0.1" in done.stdout
    assert "TLS off; auth no; loopback yes" in done.stdout
    assert "JOBFENCE_KEY_SECRET: weak: 12 characters" in done.stdout
    assert "REFUSED: JOBFENCE_KEY_SECRET" in done.stdout and "short-secret" not in done.stdout
    allowed = run_cli("check", env={**env, "JOBFENCE_ALLOW_INSECURE": "weak-key-secret"})
    assert allowed.returncode == 0, allowed.stdout
    assert "allowed by JOBFENCE_ALLOW_INSECURE=weak-key-secret" in allowed.stdout


# --------------------------------------------------------------------------- credentials


@pytest.fixture(scope="module")
def password_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        server.client().config_set("requirepass", "RIGHTpw#42x")
        try:
            yield server
        finally:  # the server's own stop and probes log in without a password
            import redis

            redis.Redis(port=server.port, password="RIGHTpw#42x").config_set("requirepass", "")


def test_a_wrong_redis_password_is_refused_not_waited_for(password_redis: RedisServer) -> None:
    for password in ("WRONGpwXYZ", None):
        auth = f":{password}@" if password else ""
        url = f"redis://{auth}127.0.0.1:{password_redis.port}/0"
        settings = quiet_settings(lock_url=url, key_secret=STRONG)
        runtime = Runtime(settings)
        try:
            found = list(check_lock_backend(SimpleNamespace(task_always_eager=False), runtime))
        finally:
            runtime.close()
        assert [f.refuse for f in found] == [True], found
        text = shown(str(found[0]))
        assert "wrong credentials, not an outage" in text and "starting anyway" not in text
    right = f"redis://:RIGHTpw%2342x@127.0.0.1:{password_redis.port}/0"
    done = run_cli("check", env={"JOBFENCE_LOCK_URL": right})
    assert done.returncode == 0, done.stdout + done.stderr
    wrong_url = right.replace("RIGHTpw%2342x", "WRONGpwXYZ")
    wrong = run_cli("check", env={"JOBFENCE_LOCK_URL": wrong_url})
    assert wrong.returncode == EX_CONFIG and "wrong credentials" in wrong.stdout


# --------------------------------------------------------------------------- CLI output


def test_locks_list_and_inspect_escape_control_characters(redis_url: str) -> None:
    backend = RedisBackend.from_url(redis_url)
    hostile = "evil\x1bc\x08\x9b31mX\rOVER"
    try:
        lease = backend.try_acquire(
            hostile, 60.0,
            meta=OwnerMeta(host="h\x1b[8mHIDDEN", pid=1, task_id="id-\x1b]0;TITLE\x07",
                           task_name="t.\x1b[2Jx"),
        )  # fmt: skip
        assert lease is not None
        env = {"JOBFENCE_LOCK_URL": redis_url}
        for args in (("locks", "list"), ("locks", "inspect", hostile),
                     ("locks", "orphans")):  # fmt: skip
            done = run_cli(*args, env=env)
            out = done.stdout + done.stderr
            assert not any(c in out for c in "\x1b\x07\x08\x9b\r"), (args, out)
            if args[1] != "orphans":
                assert "\\x1b" in out, out
        listed = json.loads(run_cli("locks", "list", "--json", env=env).stdout)
        assert listed[0]["key"] == hostile  # JSON keeps the data, escaped by the encoder
    finally:
        backend.close()


# --------------------------------------------------------------------------- signed messages


def test_celerys_auth_serializer_is_accepted_by_settings_decorator_and_checks() -> None:
    from celery import Celery

    from jobfence.tasks import singleton_task

    assert load_settings(accept_content="json,auth").accept_content == ("json", "auth")
    conf = SimpleNamespace(accept_content=["auth"], result_accept_content=["json", "auth"],
                           task_serializer="auth", result_serializer="json",
                           event_serializer="json")  # fmt: skip
    assert list(check_serializers(conf)) == []
    conf.accept_content = ["auth", "pickle"]
    assert [f.refuse for f in check_serializers(conf)] == [True]
    app = Celery("tests-signed", set_as_current=False)

    def signed() -> None:
        """A body."""

    task = singleton_task(app=app, shared=False, name="tests.signed", serializer="auth")(signed)
    assert task.serializer == "auth"


SIGNED_APP = """
import os

import redis
from celery import Celery

import jobfence
from jobfence.tasks import singleton_task

app = Celery("signed_app", broker=os.environ["SIGNED_BROKER"])
app.conf.update(
    task_serializer="auth", accept_content=["auth"], security_key="key.pem",
    security_certificate="cert.pem", security_cert_store="cert*.pem",
    worker_hijack_root_logger=False,
)
jobfence.setup(app)
app.setup_security()


@singleton_task(app=app, name="signed.mark")
def mark(n: int) -> None:
    redis.Redis.from_url(os.environ["SIGNED_BROKER"]).set(f"signed-done-{n}", "1")
"""


@pytest.mark.integration
def test_a_real_worker_runs_signed_messages_and_drops_unsigned_ones(
    redis_url: str, tmp_path: Path
) -> None:
    """Celery's message signing end to end: a worker of an app with app.setup_security()
    passes jobfence's start-up checks and runs a signed job; an unsigned JSON message for
    the same task (the control) is refused by Celery and never runs."""
    import redis
    from celery import Celery

    from devstack.servers import stop_process, wait_for

    _self_signed(tmp_path)  # cert.pem, key.pem: the signer's own self-signed certificate
    (tmp_path / "signed_app.py").write_text(SIGNED_APP)
    env = {**os.environ, "SIGNED_BROKER": redis_url, "JOBFENCE_LOCK_URL": redis_url,
           "JOBFENCE_KEY_SECRET": STRONG,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}  # fmt: skip
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "signed_app", "worker", "--pool", "solo",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: "ready" in log.read_text() or worker.poll() is not None, 60,
                 message=lambda: log.read_text())  # fmt: skip
        assert worker.poll() is None, log.read_text()  # not refused at start-up (exit 78)
        plain = Celery("unsigned", broker=redis_url, set_as_current=False)
        plain.send_task("signed.mark", args=(8,), serializer="json")  # the control
        subprocess.run(
            [sys.executable, "-c", "import signed_app; signed_app.mark.delay(7)"],
            cwd=tmp_path, env=env, check=True, timeout=60,
        )  # fmt: skip
        wait_for(lambda: client.get("signed-done-7"), 60, message=lambda: log.read_text())
        assert client.get("signed-done-8") is None  # delivered first, refused, never run
        text = log.read_text()
        assert "ContentDisallowed" in text or "Refusing to deserialize" in text, text
        assert "refusing to start" not in text
    finally:
        stop_process(worker)
        client.close()
    shown(log.read_text())


# --------------------------------------------------------------------------- metrics


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)  # Celery: RSA only
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress

    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))  # fmt: skip
    return str(cert_file), str(key_file)


def test_the_metrics_endpoint_binds_loopback_by_default() -> None:
    assert Settings(lock_url="memory://").metrics_addr == "127.0.0.1"


def test_the_metrics_endpoint_with_basic_auth_and_tls(tmp_path: Path) -> None:
    from jobfence.worker.metrics_server import Exporter

    certfile, keyfile = _self_signed(tmp_path)
    port = free_port()
    settings = Settings(lock_url="memory://", metrics_port=port,
                        metrics_basic_auth="prom:MetricsPW77", metrics_certfile=certfile,
                        metrics_keyfile=keyfile)  # fmt: skip
    runtime = Runtime(settings)
    exporter = Exporter.start(runtime, multiprocess=False)
    try:
        context = ssl.create_default_context(cafile=certfile)
        url = f"https://127.0.0.1:{port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(url, context=context, timeout=5)
        assert denied.value.code == 401
        assert "CPython" not in str(denied.value.headers.get("Server"))
        token = base64.b64encode(b"prom:MetricsPW77").decode()
        request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
        with urllib.request.urlopen(request, context=context, timeout=5) as reply:
            body = reply.read().decode()
            server = reply.headers.get("Server", "")
        assert "jobfence" in body and "CPython" not in server and "Python" not in server
        shown(body + server)
        with pytest.raises(OSError):  # no plain HTTP on the TLS port
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        exporter.stop()
        runtime.close()


def test_metrics_tls_and_auth_settings_are_checked() -> None:
    with pytest.raises(UnsafeSettings, match="JOBFENCE_METRICS_CERTFILE"):
        Settings(lock_url="memory://", metrics_port=9816, metrics_certfile="/c.pem")
    with pytest.raises(UnsafeSettings) as refused:
        Settings(lock_url="memory://", metrics_port=9816, metrics_basic_auth="MetricsPW77")
    assert shown(str(refused.value)) and "user:password" in str(refused.value)


# --------------------------------------------------------------------------- demo


def test_the_demo_takes_server_urls_from_the_environment_or_a_file(tmp_path: Path) -> None:
    from demo.storm import build_parser, server_urls

    lock = "redis://:PWsecretXYZ@127.0.0.1:6379/3"
    env = {"JOBFENCE_LOCK_URL": lock, "JOBFENCE_BROKER_URL": "redis://127.0.0.1:6379/4"}
    args = build_parser().parse_args(["--env", "--database", "sqlite:///x.db"])
    assert server_urls(args, env) == {"broker": "redis://127.0.0.1:6379/4",
                                      "lock_backend": lock, "database": "sqlite:///x.db"}
    # Without --env the environment is not read: a production JOBFENCE_LOCK_URL stays out.
    assert set(server_urls(build_parser().parse_args([]), env).values()) == {None}
    file = tmp_path / "demo.env"
    file.write_text(f"JOBFENCE_LOCK_URL={lock}\n")
    file.chmod(0o600)
    args = build_parser().parse_args(["--env-file", str(file)])
    assert server_urls(args, {})["lock_backend"] == lock
    with pytest.raises(UnsafeSettings, match="--env-file"):
        server_urls(build_parser().parse_args(["--env-file", str(tmp_path / "none")]), {})


# --------------------------------------------------------------------------- the driver's hosts

PG_ENV = ("PGHOST", "PGHOSTADDR", "PGSERVICE")


@pytest.fixture
def no_pg_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in PG_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("url", "env", "loopback"),
    [
        ("postgresql://jf:PWsecretXYZ@/jobfence?host=db1", {}, False),
        ("postgresql://jf:PWsecretXYZ@/jobfence?host=127.0.0.1&host=db1", {}, False),  # libpq
        ("postgresql://jf:PWsecretXYZ@/jobfence?host=db1&host=127.0.0.1", {}, False),  # SQLAlchemy
        ("postgresql://jf:PWsecretXYZ@/jobfence?host=localhost,db1&port=5432,5432", {}, False),
        ("postgresql+psycopg://jf:PWsecretXYZ@/jobfence?host=db1", {}, False),
        ("db+postgresql://jf:PWsecretXYZ@/jobfence?host=db1", {}, False),
        ("postgresql://jf:PWsecretXYZ@localhost/jobfence?host=db1", {}, False),
        ("postgresql://jf:PWsecretXYZ@localhost/jobfence?hostaddr=10.1.2.3", {}, False),
        ("postgresql://jf:PWsecretXYZ@/jobfence?service=jobfence", {}, False),
        ("postgresql://jf:PWsecretXYZ@/jobfence", {"PGSERVICE": "jobfence"}, False),
        ("postgresql://jf:PWsecretXYZ@/jobfence", {"PGHOST": "db1"}, False),
        ("postgresql://jf:PWsecretXYZ@localhost/jobfence", {"PGHOSTADDR": "10.1.2.3"}, False),
        ("mysql+pymysql://jf:PWsecretXYZ@/jobfence?host=db1", {}, False),  # SQLAlchemy's
        ("postgresql://jf:PWsecretXYZ@/jobfence", {}, True),  # the default socket
        ("postgresql://jf:PWsecretXYZ@/jobfence?host=/run/postgresql", {}, True),
        ("postgresql://jf:PWsecretXYZ@%2Frun%2Fpostgresql/jobfence", {}, True),
        ("postgresql://jf:PWsecretXYZ@/jobfence", {"PGHOST": "/run/postgresql"}, True),
        ("postgresql://jf:PWsecretXYZ@localhost/jobfence", {"PGHOST": "db1"}, True),  # URL's wins
        ("postgresql://jf:PWsecretXYZ@localhost/jobfence?host=127.0.0.1&hostaddr=::1", {}, True),
    ],
)
def test_loopback_is_judged_on_every_host_the_driver_may_use(
    url: str, env: dict[str, str], loopback: bool, no_pg_env: pytest.MonkeyPatch
) -> None:
    """libpq and SQLAlchemy connect to a `host=`/`hostaddr=` in the query (or PGHOST, or a
    service's) over an empty or loopback authority; only a `/` directory is a socket."""
    for name, value in env.items():
        no_pg_env.setenv(name, value)
    posture = url_posture(url, "JOBFENCE_LOCK_URL")
    assert posture is not None and posture.loopback is loopback, posture


@pytest.mark.parametrize(
    ("query", "item"),
    [("host=db1&sslmode=disable", "cleartext"), ("host=127.0.0.1&host=db1", "unverified-tls")],
)
def test_a_postgres_host_in_the_query_is_refused_as_another_host(
    query: str, item: str, no_pg_env: pytest.MonkeyPatch
) -> None:
    """Clear text, unverified TLS and the public key secret: each refused, as for db1 in
    the authority."""
    found = findings(quiet_settings(lock_url=f"postgresql://jf:CLEARpw123@/jobfence?{query}"))
    fixes = " ".join(f.fix for f in found if f.refuse)
    assert f"JOBFENCE_ALLOW_INSECURE={item}" in fixes
    assert "JOBFENCE_ALLOW_INSECURE=weak-key-secret" in fixes


@pytest.mark.parametrize(
    ("query", "item"),
    [
        ("ssl_mode=REQUIRED", "unverified-tls"),
        ("ssl_mode=VERIFY_CA", "unverified-tls"),
        ("ssl_mode=DISABLED", "cleartext"),
        ("ssl_ca=/ca.pem&ssl_disabled=true", "cleartext"),
        ("ssl_mode=VERIFY_IDENTITY", None),
    ],
)
def test_a_mysql_urls_ssl_mode_is_judged_as_the_connection_reads_it(
    query: str, item: str | None
) -> None:
    url = f"mysql+pymysql://jf:PWsecretXYZ@10.1.2.3:3306/jobfence?{query}"
    settings = quiet_settings(lock_url="redis://127.0.0.1:6379/0", key_secret=STRONG,
                              database_url=url)  # fmt: skip
    refused = [f for f in findings(settings) if f.refuse]
    if item is None:
        assert refused == []
    else:
        assert [f.setting for f in refused] == ["JOBFENCE_DATABASE_URL"]
        assert f"JOBFENCE_ALLOW_INSECURE={item}" in refused[0].fix


def _this_hosts_name() -> tuple[str, str]:
    """A name of this host that is no loopback literal (judged another host, as a man in
    the middle's would be), and the address it resolves to (127.0.0.1 in /etc/hosts here)."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        pytest.skip(f"this host's name {name!r} does not resolve")
    if is_loopback(name):
        pytest.skip(f"this host's name {name!r} is a loopback literal")
    return name, address


def _start_like_a_worker(url: str) -> list[Any]:
    """Judge the settings first (no connection); open the lock server only if nothing is
    refused, as the start-up does once every process refuses before connecting."""
    refused = [f for f in findings(quiet_settings(lock_url=url, key_secret=STRONG)) if f.refuse]
    if not refused:
        backend = open_backend(url, socket_timeout=5.0)
        try:
            with pytest.raises(BackendUnavailable):
                backend.try_acquire("probe", 5)
        finally:
            backend.close()
    return refused


@pytest.mark.parametrize("sslmode", ["disable", "prefer"])
def test_a_fake_postgres_named_in_the_query_never_gets_the_password(
    sslmode: str, no_pg_env: pytest.MonkeyPatch
) -> None:
    name, address = _this_hosts_name()
    with FakePostgres(address) as fake:
        url = (f"postgresql://jf:CLEARpw123@/jobfence?host={name}&port={fake.port}"
               f"&sslmode={sslmode}&connect_timeout=5")  # fmt: skip
        # Control: libpq does send the password there, in clear text.
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(url).close()
        fake.served(1)
        assert fake.got("CLEARpw123")
        refused = _start_like_a_worker(url)
        assert refused, "judged loopback: the lock server would get the password"
        assert fake.seen == 1, "a connection went out after the refusal"
    assert {f.setting for f in refused} == {"JOBFENCE_LOCK_URL"}


# --------------------------------------------------------------------------- the leak check


def test_no_output_collected_above_shows_a_test_password() -> None:
    leaks = [t for t in SEEN for p in PASSWORDS if p in t]
    assert leaks == []
