"""The dashboard against a DNS-rebinding page and unauthenticated clients: `jobfence dashboard`
as a real process over a real Redis, spoken to in raw HTTP (a browser on a rebinding page sends
the attacker's name as Host, and an Origin matching it)."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the dashboard extra: pip install 'jobfence[dashboard]'")
from starlette.testclient import TestClient

from jobfence.locks import LockBackend, RedisBackend, open_backend
from jobfence.worker.dashboard.asgi import build_app
from jobfence.worker.dashboard.core import Dashboard
from jobfence.worker.dashboard.data import key_id
from tests.servers import free_port, stop_process, wait_for
from tests.test_dashboard import JOB_KEY, dead_pid, hold

PREFIX = "dashsec"
TOKEN = "Qm7r-" + "kP2vX9wL" * 5  # 45 characters, as `secrets.token_urlsafe(32)` gives
LOGIN_COOKIE = "jobfence_dash_login"
HIDDEN = re.compile(r'type="hidden" name="(\w+)" value="([^"]*)"')


def _env(**extra: str) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("JOBFENCE_DASHBOARD_TOKEN", None)
    return {**env, "JOBFENCE_KEY_PREFIX": PREFIX, **extra}


class Http:
    """One browser-like client of 127.0.0.1:port: it sends the Host it is told and keeps the
    cookies it is given."""

    def __init__(self, port: int, host: str, headers: dict[str, str] | None = None) -> None:
        self.port, self.host, self.headers = port, host, headers or {}
        self.cookies: dict[str, str] = {}

    def send(
        self, method: str, path: str, form: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, str, http.client.HTTPMessage]:  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        body = None
        hdrs = {"Host": self.host, **self.headers, **(headers or {})}
        if self.cookies:
            hdrs["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        if form is not None:
            import urllib.parse

            body = urllib.parse.urlencode(form)
            hdrs["Content-Type"] = "application/x-www-form-urlencoded"
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            text = resp.read().decode()
        finally:
            conn.close()
        for value in resp.headers.get_all("set-cookie") or []:
            name, _, rest = value.partition("=")
            self.cookies[name] = rest.split(";", 1)[0]
        return resp.status, text, resp.headers

    def get(self, path: str) -> tuple[int, str]:
        status, text, _ = self.send("GET", path)
        return status, text


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    b = open_backend(redis_url, prefix=PREFIX)
    assert isinstance(b, RedisBackend)
    yield b
    b.close()


@pytest.fixture
def served(redis_url: str) -> Iterator[int]:
    """`jobfence dashboard --allow-actions` on 127.0.0.1 with a token set; its port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobfence", "dashboard", "--lock-url", redis_url,
         "--port", str(port), "--allow-actions"],
        env=_env(JOBFENCE_DASHBOARD_TOKEN=TOKEN),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def up() -> bool:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
            return True
        except OSError:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else "exited"
            return False

    try:
        wait_for(up, 30, 0.1, "jobfence dashboard did not answer")
        yield port
    finally:
        stop_process(proc)
        out = proc.stdout.read() if proc.stdout else ""
        assert TOKEN not in out  # never logged, nor printed at start


def rebinding_release(client: Http, lock: str) -> list[int]:
    """What a rebinding page's script does: read the confirmation page (and the cookie it
    sets), then post the release with the Origin of its own name. The statuses it got."""
    origin = f"http://{client.host}"
    statuses = [client.get("/")[0]]
    status, page = client.get(f"/confirm?id={lock}")
    statuses.append(status)
    form = dict(HIDDEN.findall(page)) or {"id": lock, "fence": "1", "token": "x"}
    status, _, _ = client.send("POST", "/release", {**form, "confirm": "yes"},
                               headers={"Origin": origin})  # fmt: skip
    return [*statuses, status]


def test_a_dns_rebinding_page_gets_421_and_releases_nothing(
    served: int, backend: RedisBackend
) -> None:
    lease = hold(backend, JOB_KEY, pid=dead_pid())
    lock = key_id(JOB_KEY)
    # The attack: evil.example resolves to 127.0.0.1 now; the browser sends its own name.
    attacker = Http(served, f"evil.example:{served}")
    assert rebinding_release(attacker, lock) == [421, 421, 421]
    assert backend.inspect(JOB_KEY) is not None  # nothing was released
    assert backend.inspect(JOB_KEY).fence == lease.fence  # type: ignore[union-attr]
    # The control: the same requests under the dashboard's own name, logged in, release it
    # (so only the Host made the difference).
    own = Http(served, f"127.0.0.1:{served}", {"Authorization": f"Bearer {TOKEN}"})
    assert rebinding_release(own, lock) == [200, 200, 200]
    assert backend.inspect(JOB_KEY) is None
    # localhost:PORT is the dashboard too; a bare "localhost" on another port is not evil.
    assert Http(served, f"localhost:{served}").get("/")[0] == 401  # allowed, then the login


def test_an_origin_outside_the_allow_list_is_refused(served: int, backend: RedisBackend) -> None:
    hold(backend, JOB_KEY, pid=dead_pid())
    lock = key_id(JOB_KEY)
    own = Http(served, f"127.0.0.1:{served}", {"Authorization": f"Bearer {TOKEN}"})
    form = dict(HIDDEN.findall(own.get(f"/confirm?id={lock}")[1]))
    for origin in ("http://evil.example", f"http://evil.example:{served}", "null"):
        status, text, _ = own.send("POST", "/release", {**form, "confirm": "yes"},
                                   headers={"Origin": origin})  # fmt: skip
        assert status == 403 and "another site" in text, origin
    assert backend.inspect(JOB_KEY) is not None


def test_unauthenticated_requests_are_refused_when_a_token_is_set(
    served: int, backend: RedisBackend
) -> None:
    hold(backend, JOB_KEY, pid=dead_pid())
    lock = key_id(JOB_KEY)
    anonymous = Http(served, f"127.0.0.1:{served}")
    for path in ("/", "/live", "/slots", "/leaders", "/records", f"/lock?id={lock}",
                 f"/confirm?id={lock}", "/nowhere"):  # fmt: skip
        status, text, headers = anonymous.send("GET", path)
        assert status == 401, path
        assert headers["WWW-Authenticate"].startswith("Bearer"), path
        assert "shop.charge" not in text and "redis" not in text, path  # nothing of the server
    status, _, _ = anonymous.send("POST", "/release", {"id": lock, "fence": "1",
                                                       "confirm": "yes"})  # fmt: skip
    assert status == 401
    wrong = Http(served, f"127.0.0.1:{served}", {"Authorization": "Bearer " + "x" * 45})
    assert wrong.get("/")[0] == 401
    assert backend.inspect(JOB_KEY) is not None

    # The login form: a wrong token is refused; the right one sets the login cookie.
    browser = Http(served, f"127.0.0.1:{served}")
    status, page = browser.get("/records?task=shop.*")
    assert status == 401 and 'name="token"' in page
    origin = {"Origin": f"http://127.0.0.1:{served}"}
    status, page, _ = browser.send("POST", "/login", {"token": "y" * 45, "next": "/"}, origin)
    assert status == 401 and "not the token this dashboard" in page
    login = {"token": TOKEN, "next": "/records?task=shop.*"}
    status, _, headers = browser.send("POST", "/login", login, origin)
    assert status == 303 and headers["Location"] == "/records?task=shop.*"
    cookie = next(c for c in headers.get_all("set-cookie") or [] if c.startswith(LOGIN_COOKIE))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and TOKEN not in cookie
    assert browser.get("/")[0] == 200 and browser.get("/live")[0] == 200
    # A login from a rebinding page: 421 before the token is even looked at.
    assert Http(served, f"evil.example:{served}").send(
        "POST", "/login", {"token": TOKEN}, {"Origin": f"http://evil.example:{served}"}
    )[0] == 421  # fmt: skip
    # Logging out clears it.
    status, _, headers = browser.send("POST", "/logout", {}, origin)
    assert status == 303 and browser.cookies[LOGIN_COOKIE] in ('""', "")
    assert browser.get("/")[0] == 401


def _start(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """`jobfence dashboard` with `args`: it must refuse at once (a timeout means it served)."""
    return subprocess.run(
        [sys.executable, "-m", "jobfence", "dashboard", "--lock-url", "memory://",
         "--port", str(free_port()), *args],
        env=_env(**env), capture_output=True, text=True, timeout=30,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "token", "says"),
    [(["--host", "0.0.0.0"], "", "binds 0.0.0.0, off loopback"),
     (["--allow-actions"], "", "--allow-actions"),
     (["--host", "0.0.0.0", "--allow-actions"], "", "off loopback and --allow-actions"),
     ([], "short-token-of-20-ch", "too weak (20 characters; at least 32")],
)  # fmt: skip
def test_jobfence_dashboard_refuses_to_start_exposed_without_a_strong_token(
    args: list[str], token: str, says: str
) -> None:
    env = {"JOBFENCE_DASHBOARD_TOKEN": token} if token else {}
    try:
        done = _start(args, **env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"jobfence dashboard {' '.join(args)} started and served (no refusal)")
    assert done.returncode == 78, done.stdout + done.stderr
    assert says in done.stderr and "JOBFENCE_DASHBOARD_TOKEN" in done.stderr
    assert "secrets.token_urlsafe" in done.stderr  # how to make one
    assert not token or token not in done.stderr + done.stdout


def test_a_bad_allowed_host_is_refused_naming_the_option() -> None:
    done = _start(["--allowed-host", "http://dash.example.com/"])
    assert done.returncode == 78 and "--allowed-host 'http://dash.example.com/'" in done.stderr


# The real-process tests above import nothing new, so they run (and fail) on main as it was;
# the unit tests below import the guard module where they need it.


def test_the_host_list_matching() -> None:
    from jobfence.worker.dashboard.guard import GuardError, HostList

    hosts = HostList(["127.0.0.1:8099", "localhost:8099", "[::1]:8099", "dash.example.com"])
    for ok in ("127.0.0.1:8099", "LOCALHOST:8099", "[::1]:8099", "dash.example.com",
               "dash.example.com:443", "dash.example.com."):  # fmt: skip
        assert hosts.allows(ok), ok
    for bad in ("", "evil.example:8099", "127.0.0.1:8100", "localhost", "127.0.0.1",
                "dash.example.com.evil.example", "evil.example", "[::1]"):  # fmt: skip
        assert not hosts.allows(bad), bad
    assert hosts.allows_origin("https://dash.example.com")
    assert hosts.allows_origin("http://127.0.0.1:8099")
    assert not hosts.allows_origin("http://127.0.0.1:8100")
    for bad in ("null", "file://", "http://evil.example:8099", "javascript:alert(1)"):
        assert not hosts.allows_origin(bad), bad
    with pytest.raises(GuardError, match="empty"):
        HostList([])


def _dashboard(backend: LockBackend, **kw: object) -> TestClient:
    return TestClient(build_app(Dashboard(backend, allowed_hosts=["testserver"], **kw)))  # type: ignore[arg-type]


def test_actions_need_a_login_even_as_a_library() -> None:
    """build_app(Dashboard(actions=True)) with no token (and no Django login): read-only
    pages work, a release is refused before it looks at the lock."""
    backend = open_backend("memory://")
    hold(backend, JOB_KEY, pid=dead_pid())
    client = _dashboard(backend, actions=True)
    assert client.get("/").status_code == 200
    page = client.get("/confirm", params={"id": key_id(JOB_KEY)}).text
    form = dict(HIDDEN.findall(page))
    refused = client.post("/release", data={**form, "confirm": "yes"})
    assert refused.status_code == 403 and "JOBFENCE_DASHBOARD_TOKEN" in refused.text
    assert backend.inspect(JOB_KEY) is not None


def test_the_login_goes_on_only_to_a_page_of_the_dashboard(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = _dashboard(open_backend("memory://"), token=TOKEN)
    for nxt, where in [("/slots", "/slots"), ("//evil.example/", "/"),
                       ("https://evil.example", "/"), ("/\\evil.example", "/")]:  # fmt: skip
        resp = client.post("/login", data={"token": TOKEN, "next": nxt}, follow_redirects=False)
        assert resp.status_code == 303 and resp.headers["location"] == where, nxt
        client.cookies.clear()
    with caplog.at_level("INFO", logger="jobfence.dashboard"):
        client.post("/login", data={"token": TOKEN[:-1] + "!", "next": "/"})
        client.post("/login", data={"token": TOKEN, "next": "/"}, follow_redirects=False)
    assert "a failed login" in caplog.text and "a login from" in caplog.text
    assert TOKEN not in caplog.text and TOKEN[:-1] not in caplog.text
    assert "<token hidden>" in repr(Dashboard(open_backend("memory://"), token=TOKEN).login)


@pytest.mark.parametrize("token", ["x" * 31, "ab" * 20])
def test_a_weak_token_is_refused_by_the_library_too(token: str) -> None:
    from jobfence.worker.dashboard.guard import GuardError

    with pytest.raises(GuardError, match="JOBFENCE_DASHBOARD_TOKEN is too weak"):
        Dashboard(open_backend("memory://"), token=token)


def test_a_login_cookie_is_good_at_once_whatever_the_fraction_of_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cookie minted at t=1000.6 and checked then: its issue time must not lie ahead (it was
    rounded up to 1001 once, refusing a fresh login for half a second)."""
    from jobfence.worker.dashboard import guard

    login = guard.Login(TOKEN)
    monkeypatch.setattr(time, "time", lambda: 1000.6)
    assert login.cookie_ok(login.mint_cookie())
    assert not login.cookie_ok(login.mint_cookie()[:-1] + "0")  # a forged MAC
    monkeypatch.setattr(time, "time", lambda: 1000.6 + guard.LOGIN_TTL + 1)
    assert not login.cookie_ok("1000." + login._mac("1000"))  # expired


def test_the_token_variable_is_a_known_jobfence_variable() -> None:
    from jobfence.config.settings import unknown_variables
    from jobfence.worker.dashboard.guard import TOKEN_ENV

    assert unknown_variables({TOKEN_ENV: TOKEN}) == []  # no "unknown variable" warning for it
