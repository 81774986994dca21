"""`python -m jobfence outbox` on a real SQLite file: unsent, failing, sent, stale."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jobfence.tasks.effects import make_engine, outbox
from jobfence.worker.cli import main


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'shop.sqlite'}"


def test_it_counts_unsent_failing_and_sent_rows_and_says_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _url(tmp_path)
    engine = make_engine(url)
    now = time.time()
    with engine.begin() as conn:
        outbox.create(conn)
        conn.execute(outbox.insert(), [
            {"task_id": "a", "task_name": "t", "payload": "{}", "created_at": now - 5,
             "sent_at": None, "attempts": 0},
            {"task_id": "b", "task_name": "t", "payload": "{}", "created_at": now - 600,
             "sent_at": None, "attempts": 3},
            {"task_id": "c", "task_name": "t", "payload": "{}", "created_at": now - 9,
             "sent_at": now - 8, "attempts": 0},
        ])  # fmt: skip
    engine.dispose()
    assert main(["outbox", "--database", url]) == 1  # b has waited 600 s
    out = capsys.readouterr().out
    assert "unsent:  2 (the oldest 600" in out and "failing: 1" in out and "sent:    1" in out
    assert "stale:" in out
    assert main(["outbox", "--database", url, "--stale", "3600"]) == 0


def test_without_the_table_it_names_migrate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["outbox", "--database", _url(tmp_path)]) == 2
    assert "python -m jobfence migrate" in capsys.readouterr().err


def test_without_a_database_it_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("JOBFENCE_OUTBOX_URL", raising=False)
    monkeypatch.delenv("JOBFENCE_DATABASE_URL", raising=False)
    assert main(["outbox"]) == 2
    assert "JOBFENCE_OUTBOX_URL" in capsys.readouterr().err


def test_a_password_in_the_url_is_never_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "postgresql+psycopg://shop:s3cret-pw@127.0.0.1:1/nowhere"
    assert main(["outbox", "--database", url]) != 0
    captured = capsys.readouterr()
    assert "s3cret-pw" not in captured.out + captured.err
