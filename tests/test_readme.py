"""The README runs: each ```python block as a script against a private Redis and a scratch
PostgreSQL database, and it links nowhere outside the repository.

A block is skipped only if the line right above its fence is an HTML comment such as
`<!-- readme-test: skip (needs docker) -->`; the reason is required. A block marked
`<!-- readme-test: in (tests/django_example/proj/settings.py) -->` is a fragment of that
file, which a test runs as a whole project: it must appear there verbatim.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jobfence.worker.app import redis_db_url
from tests.conftest import scratch_database_url
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
SKIP_MARK = re.compile(r"^<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->$")
IN_MARK = re.compile(r"^<!--\s*readme-test:\s*in\s*\((?P<path>[^)]+)\)\s*-->$")
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)[^)]*\)")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None  # the reason given in the skip comment
    within: str | None = None  # the project file this fragment is part of

    @property
    def id(self) -> str:
        return f"line-{self.line}"


def python_blocks(text: str) -> list[Block]:
    """Every ```python block of `text`, with the skip reason marked right above it."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            i += 1
            body: list[str] = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"README line {start + 1}: python block never closed")
            above = lines[start - 1].strip() if start > 0 else ""
            mark = SKIP_MARK.match(above)
            part = IN_MARK.match(above)
            reason = mark["reason"] if mark else f"a fragment of {part['path']}" if part else None
            within = part["path"] if part else None
            blocks.append(Block(start + 1, "\n".join(body) + "\n", reason, within))
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks_to_run() -> None:
    assert len([b for b in BLOCKS if b.skip is None]) >= 2


def test_the_block_finder_reads_skip_marks() -> None:
    text = "intro\n<!-- readme-test: skip (needs docker) -->\n```python\nx = 1\n```\n"
    text += "\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [
        Block(3, "x = 1\n", "needs docker"),
        Block(7, "y = 2\n", None),
    ]


FRAGMENTS = [b for b in BLOCKS if b.within]


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.id for b in FRAGMENTS])
def test_the_readme_fragment_is_in_the_project_a_test_runs(block: Block) -> None:
    source = (REPO_ROOT / block.within).read_text() if block.within else ""
    assert block.code.strip() in source, f"README line {block.line}: not in {block.within}"


@pytest.fixture
def scratch_pg() -> Iterator[str]:
    """A PostgreSQL database of this test's own (README blocks create tables freely)."""
    yield from scratch_database_url(PostgresDatabase, POSTGRES_ADMIN_URL)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_readme_block_runs(block: Block, tmp_path: Path, redis_url: str, scratch_pg: str):
    if block.skip is not None:
        pytest.skip(f"README line {block.line}: {block.skip}")
    script = tmp_path / f"readme_{block.id.replace('-', '_')}.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBFENCE_", "CELERY_"))}
    env.update({
        "JOBFENCE_LOCK_URL": redis_db_url(redis_url, 0),
        "JOBFENCE_DATABASE_URL": scratch_pg,
        "JOBFENCE_KEY_SECRET": "readme-test-secret-0123456789abcdef",
        "JOBFENCE_KEY_SECRET_RESET": "true",  # other tests' secrets share this lock server
        "CELERY_BROKER_URL": redis_db_url(redis_url, 1),
        "CELERY_RESULT_BACKEND": redis_db_url(redis_url, 2),
    })  # fmt: skip
    done = subprocess.run(
        [sys.executable, script.name],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        f"README block at line {block.line} failed:\n{block.code}\n{done.stdout}\n{done.stderr}"
    )


def test_the_readme_links_only_inside_the_repository() -> None:
    text = README.read_text()
    assert "../" not in text, "the README points outside the repository"
    for match in LINK.finditer(text):
        target = match["target"].split("#", 1)[0]
        if not target:
            continue  # a link to a heading of the README itself
        assert "://" not in target, f"external link {target}"
        assert (REPO_ROOT / target).exists(), f"link to a missing file {target}"
