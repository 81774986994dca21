"""The dashboard's pages through its ASGI shell: bad input gets a clear page and changes
nothing, actions are confirmed, token-checked and refused on a stale view or a live holder,
and no page shows a key's arguments or an owner token."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from jobfence.locks.decisions import Decision, DecisionBounds

pytest.importorskip("starlette", reason="the dashboard extra: pip install 'jobfence[dashboard]'")
from starlette.testclient import TestClient

from jobfence.locks import LockBackend, RedisBackend, open_backend
from jobfence.locks.backend import default_meta
from jobfence.locks.lease import Lease, OwnerMeta
from jobfence.worker.dashboard.asgi import build_app
from jobfence.worker.dashboard.core import Dashboard
from jobfence.worker.dashboard.data import key_id

SECRET_KEY = "invoice:4242:card-4111111111111111"  # a key built from arguments
JOB_KEY = "shop.charge:" + "0123456789abcdef" * 2 + "01234567"


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def hold(backend: LockBackend, key: str, *, pid: int | None = None, task: str = "shop.charge",
         ttl: float = 60) -> Lease:  # fmt: skip
    here = default_meta()
    meta = OwnerMeta(host=socket.gethostname(), pid=pid or here.pid, task_id=f"id-{task}",
                     task_name=task, process_start="" if pid else here.process_start)  # fmt: skip
    lease = backend.try_acquire(key, ttl, meta=meta)
    assert lease is not None
    return lease


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    b = open_backend(redis_url, prefix="dash")
    assert isinstance(b, RedisBackend)
    yield b
    b.close()


TOKEN = "t0k3n-" + "Zq9x" * 8  # the dashboard's login (JOBFENCE_DASHBOARD_TOKEN)


def client_for(backend: LockBackend, *, actions: bool = True, **options: Any) -> TestClient:
    """A logged-in client (a bearer token) of a dashboard answering TestClient's Host."""
    dashboard = Dashboard(backend, actions=actions, allowed_hosts=["testserver"], token=TOKEN,
                          **options)  # fmt: skip
    client = TestClient(build_app(dashboard), headers={"Authorization": f"Bearer {TOKEN}"})
    client.get("/")  # the browser's cookie, which action tokens are bound to
    return client


def confirm_form(client: TestClient, lock: str) -> dict[str, str]:
    page = client.get("/confirm", params={"id": lock})
    assert page.status_code == 200
    fields = dict(re.findall(r'type="hidden" name="(\w+)" value="([^"]*)"', page.text))
    assert set(fields) == {"id", "fence", "host", "pid", "token"}
    return fields


def test_pages_never_show_a_keys_arguments_or_an_owner_token(backend: RedisBackend) -> None:
    leases = [hold(backend, SECRET_KEY, task="shop.mail"), hold(backend, JOB_KEY)]
    client = client_for(backend)
    lock = key_id(SECRET_KEY)
    pages = ["/", "/slots", "/leaders", "/records", "/live", f"/lock?id={lock}",
             f"/confirm?id={lock}"]  # fmt: skip
    for path in pages:
        text = client.get(path).text
        assert "4111" not in text and "invoice" not in text, path
        assert all(lease.owner not in text for lease in leases), path
    listing = client.get("/").text
    assert f"shop.mail #{lock[:12]}" in listing  # shown as task name and key hash
    assert JOB_KEY in listing  # a job key is task name and HMAC already


@pytest.mark.parametrize(
    ("query", "field"),
    [({"key": "inv[oice"}, "key glob"), ({"key": "a{b}"}, "key glob"),
     ({"task": "x" * 300}, "task name"), ({"cursor": "DROP"}, "cursor")],
)  # fmt: skip
def test_a_malformed_filter_gets_a_page_naming_the_field(
    backend: RedisBackend, query: dict[str, str], field: str
) -> None:
    page = client_for(backend).get("/", params=query)
    assert page.status_code == 400
    assert field in page.text and "Nothing was changed" in page.text


def test_an_unknown_or_malformed_lock_id_gets_a_clear_page(backend: RedisBackend) -> None:
    client = client_for(backend)
    assert client.get("/lock", params={"id": "0" * 24}).status_code == 404
    assert "no such lock" in client.get("/lock", params={"id": "0" * 24}).text
    bad = client.get("/lock", params={"id": "../../etc"})
    assert bad.status_code == 400 and "24 hex digits" in bad.text
    assert client.get("/nowhere").status_code == 404


def test_a_confirmed_release_of_a_dead_holder_advances_the_fence(backend: RedisBackend) -> None:
    lease = hold(backend, JOB_KEY, pid=dead_pid())
    client = client_for(backend)
    form = confirm_form(client, key_id(JOB_KEY))
    done = client.post("/release", data={**form, "confirm": "yes"})
    assert done.status_code == 200, done.text
    assert backend.inspect(JOB_KEY) is None
    assert "Released" in done.text and "release by web client" not in done.text
    after = hold(backend, JOB_KEY)
    assert after.fence > lease.fence + 1  # the advance took a grant in between
    assert "released; fence advanced" in client.get("/").text  # the action log
    log = backend.decision_log(DecisionBounds())  # and the key's decision log: who, what, when
    assert log is not None
    (forced,) = [d for d in log.for_key(JOB_KEY) if d.event == "forced"]
    assert forced.fence == lease.fence and "from the dashboard" in forced.reason


def test_a_replayed_release_is_refused_and_changes_nothing(backend: RedisBackend) -> None:
    hold(backend, JOB_KEY, pid=dead_pid())
    client = client_for(backend)
    form = {**confirm_form(client, key_id(JOB_KEY)), "confirm": "yes"}
    assert client.post("/release", data=form).status_code == 200
    successor = hold(backend, JOB_KEY, pid=dead_pid())  # dead too, yet the replay is refused
    replay = client.post("/release", data=form)
    assert replay.status_code == 403 and "replay" in replay.text
    assert backend.inspect(JOB_KEY) is not None
    assert backend.inspect(JOB_KEY).fence == successor.fence  # type: ignore[union-attr]


@pytest.mark.parametrize("forgery", ["no token", "token of another lock", "other browser",
                                     "cross-site origin"])  # fmt: skip
def test_a_forged_release_is_refused_and_changes_nothing(
    backend: RedisBackend, forgery: str
) -> None:
    hold(backend, JOB_KEY, pid=dead_pid())
    hold(backend, SECRET_KEY, pid=dead_pid())
    client = client_for(backend)
    form = {**confirm_form(client, key_id(JOB_KEY)), "confirm": "yes"}
    headers = {}
    if forgery == "no token":
        del form["token"]
    elif forgery == "token of another lock":
        form["token"] = confirm_form(client, key_id(SECRET_KEY))["token"]
    elif forgery == "other browser":
        client.cookies.clear()
        client.cookies.set("jobfence_dash", "f" * 32)
    else:
        headers = {"Origin": "https://evil.example"}
    refused = client.post("/release", data=form, headers=headers)
    assert refused.status_code == 403, refused.text
    assert backend.inspect(JOB_KEY) is not None


def test_an_unconfirmed_release_is_refused(backend: RedisBackend) -> None:
    hold(backend, JOB_KEY, pid=dead_pid())
    client = client_for(backend)
    refused = client.post("/release", data=confirm_form(client, key_id(JOB_KEY)))
    assert refused.status_code == 400 and "not confirmed" in refused.text
    assert backend.inspect(JOB_KEY) is not None


def test_a_release_on_a_stale_view_is_refused(backend: RedisBackend) -> None:
    first = hold(backend, JOB_KEY, pid=dead_pid())
    client = client_for(backend)
    form = {**confirm_form(client, key_id(JOB_KEY)), "confirm": "yes"}
    backend.release_grant(JOB_KEY, first.fence)  # meanwhile: released, and taken again
    second = hold(backend, JOB_KEY, pid=dead_pid())
    stale = client.post("/release", data=form)
    assert stale.status_code == 409 and "stale view" in stale.text
    assert backend.inspect(JOB_KEY).fence == second.fence  # type: ignore[union-attr]


def test_a_release_of_a_live_holder_is_refused(backend: RedisBackend) -> None:
    hold(backend, JOB_KEY)  # held by this very process: alive
    client = client_for(backend)
    refused = client.post("/release", data={**confirm_form(client, key_id(JOB_KEY)),
                                            "confirm": "yes"})  # fmt: skip
    assert refused.status_code == 409 and "alive" in refused.text
    assert backend.inspect(JOB_KEY) is not None


def test_a_read_only_dashboard_refuses_every_action(backend: RedisBackend) -> None:
    hold(backend, JOB_KEY, pid=dead_pid())
    client = client_for(backend, actions=False)
    assert "release…" not in client.get("/").text
    refused = client.post("/release", data={**confirm_form(client, key_id(JOB_KEY)),
                                            "confirm": "yes"})  # fmt: skip
    assert refused.status_code == 403 and "--allow-actions" in refused.text
    assert backend.inspect(JOB_KEY) is not None


def test_locks_page_by_scan_cursor_and_filters(backend: RedisBackend) -> None:
    for n in range(120):
        hold(backend, f"page-{n:03d}", task="bulk.task" if n % 2 else "other.task")
    client = client_for(backend)
    seen: set[str] = set()
    url = "/?task=bulk.*"
    for _ in range(50):
        page = client.get(url).text
        seen |= set(re.findall(r'data-id="([0-9a-f]{24})"', page))
        nxt = re.search(r'id="next" href="([^"]+)"', page)
        if nxt is None:
            break
        url = nxt.group(1).replace("&amp;", "&")
        assert "cursor=r" in url  # a SCAN cursor, never KEYS
    assert seen == {key_id(f"page-{n:03d}") for n in range(1, 120, 2)}
    one = client.get("/", params={"key": "page-00?"}).text
    assert len(re.findall(r"data-id=", one)) == 10


def test_liveness_verdicts_with_reasons(backend: RedisBackend) -> None:
    hold(backend, "alive-one")
    hold(backend, "dead-one", pid=dead_pid())
    page = client_for(backend).get("/").text
    assert 'data-verdict="alive"' in page and 'data-verdict="dead"' in page
    assert "is not running on" in page and "is running on" in page


def test_a_backend_that_cannot_list_says_which_pages_it_cannot_fill() -> None:
    backend = open_backend("memory://")
    hold(backend, JOB_KEY)
    client = client_for(backend)
    assert "cannot list its semaphores" in client.get("/slots").text
    assert "cannot list its job records" in client.get("/records").text
    # memory:// keeps an in-process decision log: empty for this key; a backend with none
    # (PostgreSQL, etcd, ...) says so.
    assert "No decision recorded for this key" in client.get(f"/lock?id={key_id(JOB_KEY)}").text
    backend.decision_log = lambda bounds: None  # type: ignore[method-assign]
    assert "No decision log on this backend" in client.get(f"/lock?id={key_id(JOB_KEY)}").text
    assert JOB_KEY in client.get("/").text  # the locks page works on every backend


def test_the_lock_page_shows_decisions_when_the_backend_keeps_them(backend: RedisBackend) -> None:
    lease = hold(backend, JOB_KEY)
    log = backend.decision_log(DecisionBounds())
    assert log is not None
    log.append_many([
        Decision(time.time(), "started", JOB_KEY, "tests.pay", "t-1", lease.fence),
        Decision(time.time(), "conflict", JOB_KEY, "tests.pay", "t-9", None, "t-1", None, "skip"),
    ])  # fmt: skip
    page = client_for(backend).get(f"/lock?id={key_id(JOB_KEY)}").text
    assert "skipped: a duplicate of task t-1" in page and "t-9" in page
    assert lease.owner not in page


def test_live_figures(backend: RedisBackend) -> None:
    hold(backend, "a")
    hold(backend, "b", pid=dead_pid())
    figures = client_for(backend).get("/live").json()
    assert figures["locks"] == 2 and figures["dead"] == 1
    assert figures["waits"] is None  # no --metrics-url: unknown, not zero


# ------------------------------------------------------------ finding what a person knows
CARD = "4111111111111111"  # an argument: never shown back, never logged


@pytest.fixture
def shop(redis_url: str) -> Iterator[Any]:
    """A Celery app with a jobfence task keyed on one argument, on the dashboard's Redis."""
    from celery import Celery

    from jobfence.config import Settings
    from jobfence.tasks import install, singleton_task

    app = Celery("dashfind", set_as_current=False)
    runtime = install(app, Settings(lock_url=redis_url, key_prefix="dash",
                                    key_secret="dashfind-" + "k3y" * 12))  # fmt: skip
    app.entered, app.go = threading.Event(), threading.Event()

    @singleton_task(app=app, name="shop.charge_invoice", key=("invoice_id", "card"), shared=False)
    def charge_invoice(invoice_id: int, card: str, note: str = "") -> str:
        app.entered.set()
        assert app.go.wait(30)
        return "charged"

    @app.task(name="shop.plain_celery", shared=False)  # type: ignore[untyped-decorator]
    def plain_celery(x: int) -> int:
        return x

    yield app
    app.go.set()
    runtime.close()


def test_a_running_job_is_found_by_its_task_and_arguments(
    backend: RedisBackend, shop: Any, caplog: pytest.LogCaptureFixture
) -> None:
    worker = threading.Thread(target=shop.tasks["shop.charge_invoice"], args=(4242, CARD))
    worker.start()
    try:
        assert shop.entered.wait(30)
        client = client_for(backend, app=shop)
        key, _ = shop.tasks["shop.charge_invoice"].identity((4242, CARD), {})
        for arguments in (
            f'{{"invoice_id": 4242, "card": "{CARD}"}}',
            f'[4242, "{CARD}"]',
            f'invoice_id=4242 card="{CARD}"',
            f'card="{CARD}", invoice_id=4242',
        ):
            page = client.post("/find", data={"task": "shop.charge_invoice",
                                              "arguments": arguments})  # fmt: skip
            assert page.status_code == 200, page.text
            assert 'id="held"' in page.text and key_id(key) in page.text, arguments
            assert "alive" in page.text and CARD not in page.text and "4242" not in page.text
        other = client.post(
            "/find",
            data={"task": "shop.charge_invoice", "arguments": '{"invoice_id": 4243, "card": "x"}'},
        )
        assert 'id="not-held"' in other.text and "Nothing on this key" in other.text
    finally:
        shop.go.set()
        worker.join(30)
    done = client.post(
        "/find", data={"task": "shop.charge_invoice", "arguments": f'invoice_id=4242 card="{CARD}"'}
    )
    assert 'id="not-held"' in done.text and 'id="record"' in done.text and "DONE" in done.text
    assert CARD not in caplog.text and "dashfind-" not in done.text  # no argument, no secret
    # Behind the guard like every page: no login, 401; another Host, 421.
    dashboard = Dashboard(backend, app=shop, allowed_hosts=["testserver"], token=TOKEN)
    form = {"task": "shop.charge_invoice", "arguments": f'invoice_id=4242 card="{CARD}"'}
    anonymous = TestClient(build_app(dashboard)).post("/find", data=form)
    assert anonymous.status_code == 401 and key not in anonymous.text
    elsewhere = TestClient(build_app(dashboard), base_url="http://evil.example",
                           headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
    assert elsewhere.post("/find", data=form).status_code == 421


@pytest.mark.parametrize(
    ("form", "says"),
    [({"task": "shop.charge_invoic"}, "did you mean shop.charge_invoice"),
     ({"task": "charge_invoice"}, "did you mean shop.charge_invoice"),
     ({"task": "shop.plain_celery"}, "plain Celery task"),
     ({"task": "shop.charge_invoice", "arguments": f'{{"invoice_id": 1, "card": "{CARD}"'},
      "arguments: not valid JSON"),
     ({"task": "shop.charge_invoice", "arguments": f"invoice_id=1 {CARD}"},
      "arguments: item 2 is not name=value"),
     ({"task": "shop.charge_invoice", "arguments": f'{{"invoice": 1, "card": "{CARD}"}}'},
      "arguments: shop.charge_invoice() got an unexpected keyword argument 'invoice'")],
)  # fmt: skip
def test_finding_a_job_with_a_wrong_name_or_bad_arguments_says_which_field(
    backend: RedisBackend, shop: Any, form: dict[str, str], says: str
) -> None:
    page = client_for(backend, app=shop).post("/find", data=form)
    assert page.status_code == 400 and says.replace("'", "&#39;") in page.text, page.text
    assert CARD not in page.text


def test_finding_a_job_without_an_app_says_to_give_one(backend: RedisBackend) -> None:
    page = client_for(backend).post("/find", data={"task": "shop.charge_invoice",
                                                   "arguments": "invoice_id=1"})  # fmt: skip
    assert page.status_code == 400 and "--app proj.tasks" in page.text
    assert "--app proj.tasks" in client_for(backend).get("/find").text


def test_a_plain_lock_shows_the_name_its_owner_gave_it_unless_hidden(
    backend: RedisBackend,
) -> None:
    from jobfence.locks import Locker
    from jobfence.worker.admin import table

    with Locker(backend).lock("report:monthly"):
        hold(backend, SECRET_KEY, task="shop.mail")  # a task's key: never by its name
        listing = client_for(backend).get("/").text
        assert ">report:monthly</a>" in listing and f"lock #{key_id('report:monthly')[:12]}" \
            not in listing  # fmt: skip
        assert "report:monthly" in table(list(backend.scan("report:*")), time.time())  # as the CLI
        assert "report:monthly" in client_for(backend).get(
            f"/lock?id={key_id('report:monthly')}").text  # fmt: skip
        assert "invoice" not in listing and "4111" not in listing
        hidden = client_for(backend, hide_names=True).get("/").text
        assert "report:monthly" not in hidden and f"lock #{key_id('report:monthly')[:12]}" in hidden


def test_the_na_counters_say_how_to_turn_them_on(backend: RedisBackend) -> None:
    page = client_for(backend).get("/").text
    assert 'id="metrics-hint"' in page and "--metrics-url" in page
    assert client_for(backend).get("/live").json()["waits"] is None
    given = client_for(backend, metrics_url="http://127.0.0.1:9/metrics").get("/").text
    assert 'id="metrics-hint"' not in given  # given one: no hint to give one


def test_a_long_reason_is_one_line_on_the_list_and_whole_on_the_lock_page(
    backend: RedisBackend,
) -> None:
    host = "worker-" + "a" * 90 + ".eu-west-3.compute.internal"
    meta = OwnerMeta(host=host, pid=4321, task_id="t-1", task_name="shop.charge")
    assert backend.try_acquire(JOB_KEY, 60, meta=meta) is not None
    client = client_for(backend)
    (cell,) = re.findall(r'<td class="note reason">(.*?)</td>', client.get("/").text, re.S)
    shown = re.sub(r"<[^>]+>", "", cell).removesuffix(" more")
    assert "\n" not in cell and len(shown) <= 60 and shown.endswith("…")
    assert f'href="/lock?id={key_id(JOB_KEY)}">more</a>' in cell
    lock_page = client.get(f"/lock?id={key_id(JOB_KEY)}").text
    assert f"held on host {host}; heartbeat" in lock_page
