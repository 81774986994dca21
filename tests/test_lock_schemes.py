"""Lock URL schemes are spelled in one place, config/schemes.py (issue 32): an AST scan.

A string constant in config, locks, tasks or worker spells a lock scheme when it is
- a registered scheme followed by ``://`` (``"redis://"``, an f-string's ``f"redis://{h}"``);
- a bare registered scheme compared with something named ``scheme``
  (``urlsplit(url).scheme == "memory"``, ``scheme in ("redis", "rediss")``);
- a bare registered scheme in the value of a name spelled ``*SCHEME*`` (``TLS_SCHEME = ...``);
- a literal tuple, list, set or dict (its keys) holding two or more registered schemes: a list
  of schemes (``frozenset({"mysql", "mariadb", "mysql+pymysql", ...})``), reported whole.
A bare name elsewhere is not counted: "redis", "postgres" or "mysql" is just as often a
backend's name (``backend.name == "postgres"``) or a SQL dialect (``dialect == "mysql"``).
The few spellings that are not lock URLs (a broker's, SQLAlchemy's) are listed, each with why.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from jobfence.config.schemes import LOCK_SCHEMES

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("config", "locks", "tasks", "worker")
TABLE = "config/schemes.py"

#: (file, literal) -> why it is not a second list of lock schemes.
ALLOWED = {
    ("worker/app.py", "memory://"): "Celery's in-process broker URL, the default broker "
    "beside a memory:// lock URL (kombu's scheme, not a lock URL)",
    ("worker/broker_tls.py", "rediss"): "the broker's and result backend's URL (kombu's "
    "Redis TLS scheme), never the lock URL",
    ("locks/backends/postgres/connection.py", "postgresql://"): "libpq's own URI scheme, which "
    "conninfo_to_dict reads, whichever lock scheme the URL was given with",
    ("worker/cli_migrate.py", "postgresql+psycopg://"): "the SQLAlchemy URL (dialect+driver) of "
    "the engine `jobfence migrate-locks` inspects with, built from the lock URL's rest",
    ("worker/cli_migrate.py", "mysql+pymysql://"): "as postgresql+psycopg:// above, for MySQL",
    # Collections of names that are also schemes, but are backends' names or SQL dialects:
    ("config/urls/lock_url.py", "redis, mysql, redlock, etcd, zookeeper"): "backend names: "
    "the keys of LOCK_URL_CHECKS, each backend's own URL check",
    ("locks/advisory.py", "mysql, mariadb"): "SQLAlchemy dialect names of the connection",
    ("locks/guards/sql.py", "mysql, mariadb"): "SQLAlchemy dialect names of the connection",
    ("worker/cli_migrate.py", "postgres, mysql"): "backend names (the registry entry's name)",
}


def lock_schemes() -> frozenset[str]:
    return frozenset(s for row in LOCK_SCHEMES.values() for s in row.schemes)


#: Calls whose string argument is a backend's name, looking its schemes up in the table.
LOOKUPS = frozenset({"backend_schemes", "entry"})


def _strings(node: ast.AST) -> Iterator[ast.Constant]:
    for child in ast.walk(node):
        if isinstance(child, ast.Constant) and isinstance(child.value, str):
            yield child


def _prefilter(schemes: frozenset[str]) -> re.Pattern[str]:
    """Text any spelling needs (a scheme before '://' or a closing quote): files without it
    are not parsed, which keeps the scan fast."""
    names = "|".join(re.escape(s) for s in sorted(schemes, key=len, reverse=True))
    return re.compile(f"(?:{names})(?:://|[\"'])")


def spellings(source: str, schemes: frozenset[str]) -> list[tuple[int, str]]:
    """(line, literal) of each constant in `source` that spells one of `schemes`."""
    if not _prefilter(schemes).search(source):
        return []
    tree = ast.parse(source)
    found: dict[tuple[int, int], str] = {}
    looked_up: set[int] = set()  # backend names given to a look-up: not spellings of a scheme

    def add(const: ast.Constant) -> None:
        if id(const) not in looked_up:
            found[(const.lineno, const.col_offset)] = str(const.value)

    def bare(node: ast.AST) -> list[ast.Constant]:
        return [c for c in _strings(node) if c.value in schemes]

    nodes = list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Call):
            func = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if func in LOOKUPS:
                looked_up.update(id(arg) for arg in node.args)
    for node in nodes:
        if isinstance(node, ast.Set | ast.Tuple | ast.List | ast.Dict):
            elements = node.keys if isinstance(node, ast.Dict) else node.elts
            listed = [e for e in elements if isinstance(e, ast.Constant) and e.value in schemes]
            if len(listed) >= 2:
                found[(node.lineno, node.col_offset)] = ", ".join(c.value for c in listed)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if value.endswith("://") and value[:-3] in schemes:
                add(node)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            consts = [c for o in operands for c in bare(o)]
            if consts and any("scheme" in ast.unparse(o).lower() for o in operands):
                for const in consts:
                    add(const)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any("SCHEME" in ast.unparse(t) for t in targets):
                for const in bare(node.value):
                    add(const)
    return sorted((line, value) for (line, _), value in found.items())


def test_lock_schemes_are_spelled_only_in_the_table() -> None:
    schemes = lock_schemes()
    assert {"redis", "rediss+cluster", "redlocks", "etcds", "zookeeper"} <= schemes
    stray: list[str] = []
    allowed_seen: set[tuple[str, str]] = set()
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name == TABLE:
                continue
            for line, value in spellings(path.read_text(encoding="utf-8"), schemes):
                if (name, value) in ALLOWED:
                    allowed_seen.add((name, value))
                else:
                    stray.append(f"{name}:{line}: {value!r}")
    assert not stray, "lock schemes spelled outside config/schemes.py:\n" + "\n".join(stray)
    assert allowed_seen == set(ALLOWED), f"allowed but gone: {set(ALLOWED) - allowed_seen}"


def test_the_scan_finds_each_kind_of_spelling() -> None:
    source = (
        'A = "redlock://"\n'
        'b = f"rediss+cluster://{host}"\n'
        'if urlsplit(url).scheme in ("etcd", "etcds"): pass\n'
        'TLS_SCHEMES = {"rediss": "redis"}\n'
        'if backend.name == "postgres": pass\n'  # a backend's name, not a scheme
        'if dialect == "mysql": pass\n'  # a SQL dialect
        'REDIS_SCHEMES = backend_schemes("redis").schemes\n'  # a backend's name, looked up
        'BROKER = "amqp://"\n'  # not a lock scheme
        '_SQL = frozenset({"mysql", "mariadb", "db+mysql"})\n'
    )
    assert spellings(source, lock_schemes()) == [
        (1, "redlock://"), (2, "rediss+cluster://"), (3, "etcd"), (3, "etcd, etcds"),
        (3, "etcds"), (4, "redis"), (4, "rediss"), (9, "mysql, mariadb"),
    ]  # fmt: skip
