"""The README runs: each ```python block as a script against a private Redis and a scratch
PostgreSQL database, and it links nowhere outside the repository.

The machinery, and the marks a block may carry (`<!-- readme-test: skip (reason) -->`,
`<!-- readme-test: in (path) -->`), are in tests/markdown_blocks.py, shared with the docs
site's test (tests/test_docs.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import scratch_database_url
from tests.markdown_blocks import (
    REPO_ROOT,
    Block,
    check_fragment,
    python_blocks,
    run_block,
    unmarked_code,
)
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase

README = REPO_ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)[^)]*\)")

FRONT_PAGE_LINES = 250

BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks_to_run() -> None:
    assert [b for b in BLOCKS if b.skip is None]


def test_the_readme_is_a_front_page() -> None:
    assert len(README.read_text().splitlines()) <= FRONT_PAGE_LINES


def test_every_readme_code_block_runs_or_says_why_not() -> None:
    assert unmarked_code(README.read_text(), "README.md") == []


def test_the_block_finder_reads_skip_marks() -> None:
    text = "intro\n<!-- readme-test: skip (needs docker) -->\n```python\nx = 1\n```\n"
    text += "\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [
        Block(3, "x = 1\n", "needs docker"),
        Block(7, "y = 2\n", None),
    ]


def test_unmarked_code_is_found() -> None:
    text = "```\nls\n```\n```bash\nls\n```\n"
    text += "<!-- readme-test: skip (a shell) -->\n```bash\nls\n```\n"
    text += "```text\nout\n```\n"
    assert unmarked_code(text, "x.md") == [
        "x.md:1: a fence without a language (text, python, bash, ...)",
        "x.md:4: a bash block neither run nor marked with a skip reason",
    ]


FRAGMENTS = [b for b in BLOCKS if b.within]


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.id for b in FRAGMENTS])
def test_the_readme_fragment_is_in_the_project_a_test_runs(block: Block) -> None:
    check_fragment(block)


@pytest.fixture
def scratch_pg() -> Iterator[str]:
    """A PostgreSQL database of this test's own (README blocks create tables freely)."""
    yield from scratch_database_url(PostgresDatabase, POSTGRES_ADMIN_URL)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_readme_block_runs(block: Block, tmp_path: Path, redis_url: str, scratch_pg: str):
    if block.skip is not None:
        pytest.skip(f"{block.id}: {block.skip}")
    run_block(block, tmp_path, redis_url, scratch_pg)


def test_the_readme_links_only_inside_the_repository() -> None:
    text = README.read_text()
    assert "../" not in text, "the README points outside the repository"
    for match in LINK.finditer(text):
        target = match["target"].split("#", 1)[0]
        if not target:
            continue  # a link to a heading of the README itself
        assert "://" not in target, f"external link {target}"
        assert (REPO_ROOT / target).exists(), f"link to a missing file {target}"
