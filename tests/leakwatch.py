"""The suite-wide leak check: no log line, error or captured output of a test shows a password."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

# Every password the suite gives a server or puts in a URL (the files that use each say so).
# A test whose log records, captured output or failure text holds one fails, whatever it checked.
TEST_PASSWORDS = (
    "pa?ssWORDx", "PWsecretXYZ", "WRONGpwXYZ", "RIGHTpw#42x",  # test_security
    "MetricsPW77", "CLEARpw123",  # test_security
    "jfTLS-pw#s3cret-77", "jfX509-pw#s3cret-88",  # test_mysql_tls
    "etcd-pw:s3cret@/77", "etcd-root-pw-99",  # test_etcd_security
    "Fam1ly#TLS-pw", "Sent?nel-pw42",  # test_redis_family_tls
    "zk-digest:pw@s3cret/99",  # test_zookeeper_auth
    "zk-tls:pw@s3cret/42",  # test_zookeeper_tls
    "hunter2-Pa55",  # test_settings
)  # fmt: skip


# ... and each as a URL carries it, percent-encoded.
_FORMS = {form: password for password in TEST_PASSWORDS
          for form in (password, quote(password, safe=""))}  # fmt: skip


def shown(text: str) -> list[str]:
    """The test passwords `text` shows, as they are or percent-encoded."""
    return list(dict.fromkeys(password for form, password in _FORMS.items() if form in text))


class _Watch(logging.Handler):
    """Formats every record jobfence and its clients log (DEBUG up) and keeps those that leak."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.leaks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # a record that cannot be formatted shows nothing
            return
        if shown(text):
            self.leaks.append(f"{record.name}: {text[:300]}")


WATCH = _Watch()
LOGGERS = ("jobfence", "celery", "kombu", "redis", "kazoo", "psycopg", "pymysql", "sqlalchemy")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "shows_a_test_password: the leak watch's own control (tests/leakwatch.py)"
    )


def install() -> None:
    """Watch the clients' records at their own levels, and jobfence's from INFO up (what a
    worker run with `-l info` writes)."""
    jobfence = logging.getLogger("jobfence")
    if jobfence.level == logging.NOTSET or jobfence.level > logging.INFO:
        jobfence.setLevel(logging.INFO)
    for name in LOGGERS:
        logging.getLogger(name).addHandler(WATCH)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    """Fail the test whose phase logged, printed or raised a test password."""
    start = len(WATCH.leaks)
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if item.get_closest_marker("shows_a_test_password"):  # the watch's own control
        return
    found = WATCH.leaks[start:]
    # The captured sections accumulate over the phases: read them once, after the call.
    texts = [report.longreprtext]
    if report.when == "call":
        texts += [report.capstdout, report.capstderr, report.caplog]
    found += [f"{report.when} output: {', '.join(shown(t))}" for t in texts if t and shown(t)]
    if found and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = "a test password was shown (tests/leakwatch.py):\n" + "\n".join(
            "  " + line.replace(password, "<the password>")
            for line in found for password in shown(line) or [""]
        )
