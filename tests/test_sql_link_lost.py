"""link_lost: a database connection gone (deliver the job again) told apart from a user's error."""

from __future__ import annotations

from types import SimpleNamespace

import pymysql
import pytest
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import IntegrityError as SaIntegrityError

from jobfence.locks.sql import link_lost


@pytest.mark.parametrize("code", [2006, 2013, 2055])
def test_a_mysql_client_code_for_a_lost_link_is_lost(code: int) -> None:
    assert link_lost(pymysql.err.OperationalError(code, "Lost connection to server"))


@pytest.mark.parametrize(
    "error",
    [
        pymysql.err.IntegrityError(1062, "Duplicate entry"),
        pymysql.err.OperationalError(1213, "Deadlock found"),  # the server answered
        ValueError("the body's own failure"),
    ],
)
def test_an_error_on_a_live_connection_is_not_lost(error: Exception) -> None:
    assert not link_lost(error, SimpleNamespace(closed=False, broken=False))


def test_sqlalchemys_verdict_is_taken_and_a_users_integrity_error_is_not_lost() -> None:
    gone = DBAPIError("INSERT", {}, Exception("terminated"), connection_invalidated=True)
    assert link_lost(gone)
    assert not link_lost(SaIntegrityError("INSERT", {}, Exception("duplicate key")))


def test_a_users_error_raised_while_handling_a_lost_link_is_lost() -> None:
    try:
        try:
            raise pymysql.err.OperationalError(2013, "Lost connection")
        except pymysql.err.OperationalError as exc:
            raise RuntimeError("payment failed") from exc
    except RuntimeError as wrapped:
        assert link_lost(wrapped)


@pytest.mark.parametrize(
    "driver",
    [
        SimpleNamespace(broken=True, closed=True),  # psycopg 3
        SimpleNamespace(closed=2),  # psycopg2: broken
        SimpleNamespace(open=False),  # PyMySQL
    ],
)
def test_a_driver_connection_that_says_it_is_down_is_lost(driver: object) -> None:
    assert link_lost(ValueError("whatever the body raised"), driver)


def test_a_cancel_or_exit_is_never_lost() -> None:
    assert not link_lost(KeyboardInterrupt(), SimpleNamespace(broken=True))


class _PgError(Exception):
    """A psycopg error as it carries its SQLSTATE."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(("sqlstate", "lost"), [
    ("08006", True),  # connection failure
    ("57P01", True),  # admin shutdown (pg_terminate_backend, a restart)
    ("25P03", True),  # idle-in-transaction timeout
    ("23505", False),  # unique violation: the user's
    ("40P01", False),  # deadlock: the server answered
])  # fmt: skip
def test_a_postgres_sqlstate_that_ends_the_session_is_lost(sqlstate: str, lost: bool) -> None:
    assert link_lost(_PgError(sqlstate)) is lost
