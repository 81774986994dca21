"""The dashboard in headless Chromium (Selenium, Debian's chromedriver) against a private
redis-server, `jobfence dashboard` as a real process, and real processes holding locks: one
alive, one SIGSTOPped, one SIGKILLed. Saves a screenshot of each page under docs/img/dashboard/."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the dashboard extra: pip install 'jobfence[dashboard]'")
pytest.importorskip("selenium", reason="selenium is not installed (it is in the dev extra)")
from selenium import webdriver
from selenium.webdriver.common.by import By

from jobfence.locks import RedisBackend, open_backend
from jobfence.worker.dashboard.data import key_id
from tests.servers import free_port, stop_process, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = [name for name, at in [("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)] if not at]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"missing {' and '.join(MISSING)}: Debian's chromium and chromium-driver "
        "(.ci/setup installs them)",
    ),
]
# The README's screenshots: rewritten only when asked (JOBFENCE_SAVE_SCREENSHOTS=1), so a test
# run leaves the tree clean; otherwise they go to a temporary folder.
DOCS_SHOTS = Path(__file__).resolve().parent.parent / "docs" / "img" / "dashboard"
PREFIX = "dashb"
HOLDER = textwrap.dedent(
    """
    import sys
    from jobfence.locks import open_backend
    from jobfence.locks.backend import default_meta
    url, prefix, key, task = sys.argv[1:5]
    backend = open_backend(url, prefix=prefix)
    lease = backend.try_acquire(key, 300, meta=default_meta(task_id=f"{task}-1", task_name=task))
    print("held" if lease else "busy", flush=True)
    sys.stdin.read()  # until the test closes our stdin, or stops or kills us
    """
)
TOKEN = "br0wser-" + "Lq4zT8vN" * 5  # the dashboard's login (JOBFENCE_DASHBOARD_TOKEN)
KEYS = {  # verdict -> (task name, key): a job key is the task name and an HMAC
    "alive": ("shop.charge", "shop.charge:" + "a1" * 20),
    "stopped": ("shop.invoice", "shop.invoice:" + "b2" * 20),
    "dead": ("shop.mail", "shop.mail:" + "c3" * 20),
}


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture
def holders(redis_url: str) -> Iterator[dict[str, subprocess.Popen[str]]]:
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for verdict, (task, key) in KEYS.items():
            proc = subprocess.Popen(
                [sys.executable, "-c", HOLDER, redis_url, PREFIX, key, task],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
            )  # fmt: skip
            procs[verdict] = proc
            assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        os.kill(procs["stopped"].pid, signal.SIGSTOP)
        procs["dead"].kill()
        procs["dead"].wait(10)  # reaped: its pid is gone
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                stop_process(proc)


@pytest.fixture
def dashboard(redis_url: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobfence", "dashboard", "--lock-url", redis_url,
         "--port", str(port), "--allow-actions"],
        env={**_env(), "JOBFENCE_KEY_PREFIX": PREFIX, "JOBFENCE_DASHBOARD_TOKEN": TOKEN},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        live = urllib.request.Request(url + "/live", headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            with urllib.request.urlopen(live, timeout=1):
                return True
        except OSError:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else "exited"
            return False

    try:
        wait_for(up, 30, 0.1, "jobfence dashboard did not answer")
        yield url
    finally:
        stop_process(proc)


@pytest.fixture
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,900", "--disable-gpu"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.implicitly_wait(10)  # find_element polls until the page a click submitted is drawn
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(autouse=True)
def shots(tmp_path_factory: pytest.TempPathFactory) -> None:
    global SHOTS
    save = os.environ.get("JOBFENCE_SAVE_SCREENSHOTS") == "1"
    SHOTS = DOCS_SHOTS if save else tmp_path_factory.mktemp("dashboard-shots")


SHOTS = DOCS_SHOTS


def shot(browser: Any, name: str) -> None:
    """A PNG of the page for the docs (kept small: the viewport, not the whole page)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    wait_for(lambda: browser.find_element(By.CSS_SELECTOR, "#live b").text not in ("…", ""),
             10, 0.05, "the live figures never filled in")  # fmt: skip
    browser.save_screenshot(str(SHOTS / f"{name}.png"))


def login(browser: Any, base: str, path: str) -> None:
    """Open `path`: the login form first (a wrong token refused), then the page itself."""
    browser.get(base + path)
    browser.find_element(By.ID, "token").send_keys("w" * 40)
    browser.find_element(By.ID, "login").click()
    assert "not the token this dashboard" in browser.find_element(By.CSS_SELECTOR, ".err").text
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "login").click()
    browser.find_element(By.ID, "logout")  # polls (implicitly_wait) until the page is drawn
    assert browser.current_url == base + path


def verdicts(browser: Any) -> dict[str, str]:
    rows = browser.find_elements(By.CSS_SELECTOR, "#locks tr[data-id]")
    return {r.get_attribute("data-id"): r.get_attribute("data-verdict") for r in rows}


def release_form(browser: Any, base: str, verdict: str) -> None:
    browser.get(f"{base}/confirm?id={key_id(KEYS[verdict][1])}")
    assert "advances the key's fence" in browser.page_source


def refusal(browser: Any) -> str:
    return str(browser.find_element(By.CSS_SELECTOR, ".err").text)


def test_the_pages_show_each_holders_verdict_and_a_confirmed_release_of_the_dead_one_works(
    holders: dict[str, subprocess.Popen[str]], dashboard: str, browser: Any, redis_url: str
) -> None:
    backend = open_backend(redis_url, prefix=PREFIX)
    assert isinstance(backend, RedisBackend)
    login(browser, dashboard, "/")
    assert verdicts(browser) == {key_id(k): v for v, (_, k) in KEYS.items()}
    page = browser.page_source
    assert f"pid {holders['stopped'].pid} is stopped" in page
    assert f"pid {holders['dead'].pid} is not running" in page
    assert "shop.mail:" + "c3" * 20 in page  # shown as task name and key hash
    shot(browser, "locks")
    # Only the dead holder's row offers a release.
    links = browser.find_elements(By.CSS_SELECTOR, "#locks a.release")
    assert [a.get_attribute("href").rsplit("=", 1)[1] for a in links] == [key_id(KEYS["dead"][1])]

    browser.get(f"{dashboard}/lock?id={key_id(KEYS['stopped'][1])}")
    assert (
        "stopped" in browser.page_source
        and "Recent decisions" in browser.page_source  # Redis keeps the decision log
    )
    shot(browser, "lock-detail")

    # The same action on a live holder, and on a stopped one, is refused.
    for alive in ("alive", "stopped"):
        release_form(browser, dashboard, alive)
        browser.find_element(By.ID, "confirm").click()
        browser.find_element(By.ID, "do-release").click()
        assert "not provably dead" in refusal(browser)
        assert backend.inspect(KEYS[alive][1]) is not None

    # Without confirmation, and without the cross-site token: refused, nothing changed.
    release_form(browser, dashboard, "dead")
    browser.find_element(By.ID, "do-release").click()
    assert "not confirmed" in refusal(browser)
    release_form(browser, dashboard, "dead")
    browser.execute_script("document.querySelector('input[name=token]').remove()")
    browser.find_element(By.ID, "confirm").click()
    browser.find_element(By.ID, "do-release").click()
    assert "cross-site token is missing" in refusal(browser)
    dead = backend.inspect(KEYS["dead"][1])
    assert dead is not None

    # Confirmed: released, the fence advanced, the action logged.
    release_form(browser, dashboard, "dead")
    shot(browser, "confirm")
    browser.find_element(By.ID, "confirm").click()
    browser.find_element(By.ID, "do-release").click()
    assert "Released" in browser.find_element(By.CSS_SELECTOR, ".ok").text
    assert backend.inspect(KEYS["dead"][1]) is None
    floor = int(re.search(r"now stands at (\d+)", browser.page_source).group(1))  # type: ignore[union-attr]
    assert floor > dead.fence
    browser.get(dashboard + "/")
    assert key_id(KEYS["dead"][1]) not in verdicts(browser)
    assert "released; fence advanced" in browser.page_source
    assert backend.inspect(KEYS["alive"][1]) is not None
    backend.close()


def test_screenshots_of_the_other_pages(
    holders: dict[str, subprocess.Popen[str]], dashboard: str, browser: Any
) -> None:
    login(browser, dashboard, "/slots")
    for path, name, expect in [
        ("/slots", "slots", "Semaphores"),
        ("/leaders", "leaders", "Leaders"),
        ("/records", "records", "In flight"),
        ("/?key=shop.invoice*", "locks-filtered", "stopped"),
        ("/?key=inv[oice", "bad-filter", "unclosed"),
    ]:
        browser.get(dashboard + path)
        assert expect in browser.page_source, path
        shot(browser, name)
