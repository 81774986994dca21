"""The docs site: it builds strictly, its code runs, its reference covers the code, no link breaks.

`mkdocs build --strict` (warnings, broken links and missing anchors fail it) into a temporary
directory, once per module; every ```python block of every page runs against real servers as
the README's do (tests/markdown_blocks.py); every setting, CLI command and metric the code
defines appears in the generated reference; every internal link and anchor of the built HTML
resolves; llms.txt lists every page, each with its Markdown copy.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.conftest import scratch_database_url
from tests.markdown_blocks import (
    REPO_ROOT,
    Block,
    check_fragment,
    fenced_blocks,
    run_block,
    unmarked_code,
)
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase

DOCS = REPO_ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md"))
BLOCKS = [
    b
    for page in PAGES
    for b in fenced_blocks(page.read_text(), str(page.relative_to(REPO_ROOT)))
    if b.lang == "python"
]
BUILD_BUDGET_S = 30.0


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strictly from this checkout."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_BUDGET_S * 4,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    for page in PAGES:
        if page.parent.name == "bench" or "javascripts" in page.parts:
            continue
        rel = page.relative_to(DOCS)
        html = (
            rel.with_suffix("") / "index.html" if rel.stem != "index" else rel.with_suffix(".html")
        )
        assert (site / html).is_file(), f"{rel} was not built"


def test_every_code_block_runs_or_says_why_not() -> None:
    wrong = [w for page in PAGES for w in unmarked_code(page.read_text(), page.name)]
    assert wrong == []


FRAGMENTS = [b for b in BLOCKS if b.within]


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.id for b in FRAGMENTS])
def test_the_fragment_is_in_the_project_a_test_runs(block: Block) -> None:
    check_fragment(block)


@pytest.fixture
def scratch_pg() -> Iterator[str]:
    """A PostgreSQL database of this test's own (blocks create tables freely)."""
    yield from scratch_database_url(PostgresDatabase, POSTGRES_ADMIN_URL)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_page_block_runs(block: Block, tmp_path: Path, redis_url: str, scratch_pg: str):
    if block.skip is not None:
        pytest.skip(f"{block.id}: {block.skip}")
    run_block(block, tmp_path, redis_url, scratch_pg)


# ---------------------------------------------------------------------- the reference


def test_every_setting_is_in_the_reference(site: Path) -> None:
    from jobfence.config.settings import ENV_PREFIX, Settings

    page = (site / "reference" / "settings.md").read_text()
    assert len(Settings.model_fields) > 20
    missing = [
        ENV_PREFIX + name.upper()
        for name in Settings.model_fields
        if f"`{ENV_PREFIX}{name.upper()}`" not in page
    ]
    assert missing == []


def test_every_cli_command_and_option_is_in_the_reference(site: Path) -> None:
    from jobfence.worker.cli import build_parser

    page = (site / "reference" / "cli.md").read_text()
    missing = []

    def walk(prog: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    if f"## `{prog} {name}`" not in page:
                        missing.append(f"{prog} {name}")
                    walk(f"{prog} {name}", child)
            elif (
                action.option_strings
                and action.help != argparse.SUPPRESS
                and not isinstance(action, argparse._HelpAction)
                and f"`{action.option_strings[0]}`" not in page
            ):
                missing.append(f"{prog} {action.option_strings[0]}")

    walk("python -m jobfence", build_parser())
    assert missing == []
    assert "## `python -m jobfence locks release`" in page


def test_every_metric_is_in_the_reference(site: Path) -> None:
    from prometheus_client import CollectorRegistry

    from jobfence.tasks.metrics import Metrics

    page = (site / "reference" / "metrics.md").read_text()
    registry = CollectorRegistry()
    Metrics(registry)
    names = [m.name for m in registry.collect()]
    assert len(names) >= 12
    missing = [n for n in names if f"`{n}" not in page]
    assert missing == []


# ---------------------------------------------------------------------- links


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"] or "")
        if values.get("name"):
            self.ids.add(values["name"] or "")
        if tag in ("a", "link", "img", "script") and (values.get("href") or values.get("src")):
            self.hrefs.append(values.get("href") or values.get("src") or "")


def broken_links(site: Path) -> list[str]:
    """Every internal link of the built site whose file or anchor is missing."""
    parsed: dict[Path, _Links] = {}

    def parse(path: Path) -> _Links:
        if path not in parsed:
            links = _Links()
            links.feed(path.read_text(errors="replace"))
            parsed[path] = links
        return parsed[path]

    broken = []
    for page in sorted(site.rglob("*.html")):
        if page.name == "404.html":
            continue  # served for any path, so its links are absolute from the site's root
        for href in parse(page).hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            where = f"{page.relative_to(site)} -> {href}"
            if not target.exists():
                broken.append(f"{where}: no such file")
            elif (
                parts.fragment
                and target.suffix == ".html"
                and unquote(parts.fragment) not in parse(target).ids
            ):
                broken.append(f"{where}: no such anchor")
    return broken


def test_no_internal_link_or_anchor_is_broken(site: Path) -> None:
    assert broken_links(site) == []


def test_the_link_checker_finds_a_broken_anchor_and_file(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text('<h2 id="here">x</h2><a href="#here">ok</a>')
    (tmp_path / "index.html").write_text(
        '<a href="a/#here">ok</a><a href="a/#gone">bad</a><a href="b/">bad</a>'
        '<a href="https://example.org/">external</a>'
    )
    assert broken_links(tmp_path) == [
        "index.html -> a/#gone: no such anchor",
        "index.html -> b/: no such file",
    ]


def test_llms_txt_lists_every_page_with_its_markdown_copy(site: Path) -> None:
    listed = re.findall(r"^- \[[^\]]+\]\(([^)]+)\)", (site / "llms.txt").read_text(), re.M)
    assert "index.md" in listed and "reference/settings.md" in listed
    for src in listed:
        assert (site / src).is_file(), f"llms.txt lists {src}, which has no Markdown copy"
    built = {p.relative_to(DOCS).as_posix() for p in PAGES if p.parent.name != "bench"}
    assert built - set(listed) == set()


def test_the_diagrams_are_served_from_the_site_itself(site: Path) -> None:
    assert (site / "javascripts" / "vendor" / "mermaid.min.js").stat().st_size > 1_000_000
    html = (site / "explanation" / "safety" / "index.html").read_text()
    assert html.count('class="mermaid"') >= 3
    assert "unpkg.com" not in html and "cdn.jsdelivr" not in html


# ---------------------------------------------------------------------- references in messages

PRODUCT = ("config", "locks", "tasks", "worker")
DOC_REF = re.compile(r"docs/(?P<page>[\w./-]+?)\.md(?:#(?P<anchor>[\w-]+))?")


def message_strings(root: Path) -> Iterator[tuple[str, str]]:
    """Every string literal of the product code that is not a docstring (messages, fixes,
    descriptions), with where it is: the text users read in errors, logs and `--help`."""
    for path in sorted(p for name in PRODUCT for p in (root / name).rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if is_text and id(node) not in docstrings:
                yield f"{path.relative_to(root)}:{node.lineno}", node.value


def unresolved_references(root: Path, site: Path) -> list[str]:
    """Each reference to the documentation in a message that points nowhere: a README
    section (the README is a front page; messages point to the site's pages), or a
    `docs/PAGE.md#anchor` whose built page or anchor is missing."""
    bad = []
    parsed: dict[Path, _Links] = {}
    for where, text in message_strings(root):
        if "README" in text:
            bad.append(f"{where}: points to the README: {text!r}")
        for ref in DOC_REF.finditer(text):
            page = site / ref["page"] / "index.html"
            if ref["page"].endswith("index"):
                page = site / ref["page"].removesuffix("index") / "index.html"
            if not page.exists():
                bad.append(f"{where}: {ref[0]}: no such page")
                continue
            if ref["anchor"]:
                if page not in parsed:
                    parsed[page] = _Links()
                    parsed[page].feed(page.read_text(errors="replace"))
                if ref["anchor"] not in parsed[page].ids:
                    bad.append(f"{where}: {ref[0]}: no such anchor")
    return bad


def test_every_reference_to_the_docs_in_a_message_resolves(site: Path) -> None:
    """Issue 31, item 6: "README, Settings: rotating the key secret" and "README, Security"
    pointed nowhere. Every page and anchor a message names exists in the built site."""
    assert unresolved_references(REPO_ROOT, site) == []


def test_the_reference_check_finds_a_readme_section_a_missing_page_and_anchor(
    tmp_path: Path, site: Path
) -> None:
    """The control: the forms the messages used before, and broken page and anchor refs."""
    module = tmp_path / "config" / "m.py"
    module.parent.mkdir()
    module.write_text(
        '"""Doc."""\n'
        'A = "fix it (README, Settings: rotating the key secret)"\n'
        'B = "see docs/reference/nothing-here.md"\n'
        'C = "see docs/how-to/backends/sql.md#no-such-heading"\n'
        'D = "see docs/how-to/backends/sql.md#behind-pgbouncer"\n'
    )
    for name in PRODUCT[1:]:
        (tmp_path / name).mkdir()
    found = unresolved_references(tmp_path, site)
    assert [f.split(": ", 1)[0] for f in found] == [f"config/m.py:{n}" for n in (2, 3, 4)]
