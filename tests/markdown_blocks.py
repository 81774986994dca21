"""Runs the code blocks of a Markdown file (the README, each docs/ page) as the suite's tests.

Each ```python block runs as a script against a private Redis and a scratch PostgreSQL
database. A block is skipped only if the line right above its fence is an HTML comment such as
`<!-- readme-test: skip (needs docker) -->`; the reason is required. A block marked
`<!-- readme-test: in (tests/django_example/proj/settings.py) -->` is a fragment of that file,
which a test runs as a whole project: it must appear there verbatim. Every other fence must
name its language: `text` (output, a table of numbers) and `mermaid` (a diagram) are not code;
any other language (`bash`, ...) is code that must carry a skip mark with its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jobfence.worker.app import redis_db_url

REPO_ROOT = Path(__file__).resolve().parents[1]
SKIP_MARK = re.compile(r"^<!--\s*readme-test:\s*skip\s*\((?P<reason>.+)\)\s*-->$")
IN_MARK = re.compile(r"^<!--\s*readme-test:\s*in\s*\((?P<path>[^)]+)\)\s*-->$")
NOT_CODE = ("text", "mermaid")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None  # the reason given in the skip comment
    within: str | None = None  # the project file this fragment is part of
    lang: str = "python"
    source: str = "README.md"  # the file, relative to the repository

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


def fenced_blocks(text: str, source: str = "README.md") -> list[Block]:
    """Every fenced block of `text`, with its language and the mark right above it."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = lines[i].strip()
        if opening.startswith("```"):
            start = i
            lang = opening.removeprefix("```").strip()
            i += 1
            body: list[str] = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{source} line {start + 1}: block never closed")
            above = lines[start - 1].strip() if start > 0 else ""
            mark = SKIP_MARK.match(above)
            part = IN_MARK.match(above)
            reason = mark["reason"] if mark else f"a fragment of {part['path']}" if part else None
            within = part["path"] if part else None
            code = "\n".join(body) + "\n"
            blocks.append(Block(start + 1, code, reason, within, lang, source))
        i += 1
    return blocks


def python_blocks(text: str, source: str = "README.md") -> list[Block]:
    """Every ```python block of `text`, with the skip reason marked right above it."""
    return [b for b in fenced_blocks(text, source) if b.lang == "python"]


def unmarked_code(text: str, source: str) -> list[str]:
    """The blocks that break the rules: no language, or code other than Python with no mark."""
    wrong = []
    for b in fenced_blocks(text, source):
        if not b.lang:
            wrong.append(f"{b.id}: a fence without a language (text, python, bash, ...)")
        elif b.lang not in (*NOT_CODE, "python") and b.skip is None:
            wrong.append(f"{b.id}: a {b.lang} block neither run nor marked with a skip reason")
    return wrong


def check_fragment(block: Block) -> None:
    source = (REPO_ROOT / block.within).read_text() if block.within else ""
    assert block.code.strip() in source, f"{block.id}: not in {block.within}"


def run_block(block: Block, workdir: Path, redis_url: str, database_url: str) -> None:
    """Run one Python block as a script in `workdir`, its servers given by JOBFENCE_*."""
    script = workdir / f"block_{block.line}.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBFENCE_", "CELERY_"))}
    env.update({
        "JOBFENCE_LOCK_URL": redis_db_url(redis_url, 0),
        "JOBFENCE_DATABASE_URL": database_url,
        "JOBFENCE_KEY_SECRET": "readme-test-secret-0123456789abcdef",
        "JOBFENCE_KEY_SECRET_RESET": "true",  # other tests' secrets share this lock server
        "CELERY_BROKER_URL": redis_db_url(redis_url, 1),
        "CELERY_RESULT_BACKEND": redis_db_url(redis_url, 2),
    })  # fmt: skip
    done = subprocess.run(
        [sys.executable, script.name],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        f"block at {block.id} failed:\n{block.code}\n{done.stdout}\n{done.stderr}"
    )
