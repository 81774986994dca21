"""The leak watch itself: a record that shows a test password is caught (then forgotten here)."""

from __future__ import annotations

import logging

import pytest

from tests import leakwatch


@pytest.mark.shows_a_test_password
def test_a_record_showing_a_test_password_is_caught() -> None:
    before = len(leakwatch.WATCH.leaks)
    logging.getLogger("jobfence.tasks").warning("login to redis://:%s@h failed", "RIGHTpw#42x")
    logging.getLogger("jobfence.tasks").warning("login to redis://:***@h failed")
    caught = leakwatch.WATCH.leaks[before:]
    del leakwatch.WATCH.leaks[before:]  # the control's own leak must not fail this test
    assert len(caught) == 1 and "jobfence.tasks" in caught[0]


def test_shown_names_each_password_in_a_text() -> None:
    assert leakwatch.shown("a Sent?nel-pw42 and hunter2-Pa55") == ["Sent?nel-pw42", "hunter2-Pa55"]
    assert leakwatch.shown("redis://:***@host") == []
