"""No import cycle among jobfence's product modules (issue 32), function-local imports included.

The scan reads the source (AST), so it sees imports inside functions that an import-time
check would miss. Rules:

- every ``import jobfence.x`` / ``from jobfence.x import y`` / relative import in config,
  locks, tasks and worker is an edge, wherever it sits (module level or inside a function);
- ``from pkg import name`` where ``pkg.name`` is a module is an edge to that module, else an
  edge to ``pkg`` (its ``__init__``);
- imports under ``if TYPE_CHECKING:`` are not edges: they never run, so they cannot form a
  runtime cycle (they only feed the type checker);
- importing ``pkg.mod`` from outside ``pkg`` is also an edge to ``pkg`` (Python runs
  ``pkg/__init__`` first); from inside ``pkg`` it is not, as ``pkg/__init__`` has already
  started. So a package's ``__init__`` re-exporting its submodules is fine unless one of
  them imports that ``__init__`` by name, or a module outside the package that does.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("config", "locks", "tasks", "worker")

Graph = dict[str, set[str]]


def module_files(root: Path, top: str, packages: tuple[str, ...]) -> dict[str, Path]:
    """Each product module's dotted name (under `top`) to its source file."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([top, *parts])] = path
    return found


# An import statement at the start of a line (its indent, then the statement).
_IMPORT = re.compile(r"[ \t]*(?:from[ \t]+[\w.]+[ \t]+import\b|import[ \t]+\w)")
_TYPE_CHECKING = re.compile(r"if[ \t]+(?:typing\.)?TYPE_CHECKING[ \t]*:")


def _runtime_imports(source: str) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth, skipping ``if TYPE_CHECKING:`` bodies
    (their ``else:`` branch does run).

    Each statement is found by its line and parsed with `ast`; the blocks around it are told
    by indentation, triple-quoted strings skipped. Parsing whole files took about a second
    for the product's 1.4 MB; this takes a tenth of that. A stray match (an import inside a
    string that is not triple-quoted) can only add an edge, never hide one.
    """
    found: list[ast.Import | ast.ImportFrom] = []
    lines = source.splitlines()
    blocks: list[tuple[int, bool]] = []  # open blocks: (header's indent, TYPE_CHECKING body)
    quote: str | None = None  # the delimiter of the triple-quoted string we are inside
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if quote is not None:
            if line.count(quote) % 2:
                quote = None
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        while blocks and blocks[-1][0] >= indent:
            blocks.pop()
        if _IMPORT.match(line):
            statement = stripped
            while statement.count("(") > statement.count(")") or statement.endswith("\\"):
                statement = statement.removesuffix("\\") + " " + lines[i].strip()
                i += 1
            if not any(checking for _, checking in blocks):
                node = ast.parse(statement).body[0]
                assert isinstance(node, ast.Import | ast.ImportFrom)
                found.append(node)
            continue
        for delimiter in ('"""', "'''"):
            if line.count(delimiter) % 2:
                quote = delimiter
        if stripped.split("#", 1)[0].rstrip().endswith(":"):
            blocks.append((indent, bool(_TYPE_CHECKING.match(stripped))))
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name a ``from ... import`` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _entered(module: str, target: str, files: dict[str, Path]) -> set[str]:
    """What importing `target` from `module` runs: `target`, and each package above it that
    `module` is not already inside (Python runs ``pkg/__init__`` before ``pkg.mod``)."""
    parts = target.split(".")
    runs = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in runs if m in files and m != module and not module.startswith(m + ".")}


def import_graph(files: dict[str, Path]) -> Graph:
    """Each module to the product modules it imports at run time."""
    graph: Graph = {name: set() for name in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _runtime_imports(path.read_text(encoding="utf-8")):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(module, is_package, node)
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.append(submodule if submodule in files else source)
            for target in (t for t in targets if t in files):
                graph[module].update(_entered(module, target, files))
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle as a path that ends where it starts, or None (iterative DFS)."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    for start in sorted(graph):
        if colour[start] != white:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        colour[start] = grey
        while stack:
            node, pending = stack[-1]
            if not pending:
                colour[node] = black
                stack.pop()
                continue
            nxt = pending.pop()
            if colour[nxt] == grey:
                path = [n for n, _ in stack]
                return [*path[path.index(nxt) :], nxt]
            if colour[nxt] == white:
                colour[nxt] = grey
                stack.append((nxt, sorted(graph[nxt])))
    return None


def test_no_import_cycle_among_product_modules() -> None:
    graph = import_graph(module_files(ROOT, "jobfence", PRODUCT))
    assert len(graph) > 50  # the scan found the product, not an empty tree
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_scan_finds_a_cycle_through_a_function_local_and_a_relative_import(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A package."""\n')
    (pkg / "a.py").write_text(
        '"""A module that names\nfrom top.pkg import d\nin its docstring."""\n'
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from top.pkg import c\nelse:\n    import top.pkg.d\n"
        "def f() -> None:\n    from top.pkg import (\n        b,\n    )\n"
    )
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("import top.pkg.a\n")
    (pkg / "d.py").write_text('"""No import."""\n')
    graph = import_graph(module_files(tmp_path, "top", ("pkg",)))
    # Neither the TYPE_CHECKING import nor the docstring's line is an edge; the else branch is.
    assert graph["top.pkg.a"] == {"top.pkg.b", "top.pkg.d"}
    assert graph["top.pkg.c"] == {"top.pkg.a"}
    assert find_cycle(graph) == ["top.pkg.a", "top.pkg.b", "top.pkg.a"]
    (pkg / "b.py").write_text('"""No import."""\n')
    assert find_cycle(import_graph(module_files(tmp_path, "top", ("pkg",)))) is None


def test_importing_a_submodule_from_outside_runs_its_package(tmp_path: Path) -> None:
    for package, text in (("p", "from top.p import m\n"), ("q", "import top.p.other\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(text)
    (tmp_path / "p" / "m.py").write_text("from top.q import __name__\n")
    (tmp_path / "p" / "other.py").write_text('"""No import."""\n')
    graph = import_graph(module_files(tmp_path, "top", ("p", "q")))
    assert graph["top.q"] == {"top.p", "top.p.other"}  # p/__init__ runs first
    assert graph["top.p.m"] == {"top.q"}  # inside p: its __init__ has started already
    # q never names p.m: the loop goes through p/__init__, which re-exports m.
    assert find_cycle(graph) == ["top.p", "top.p.m", "top.q", "top.p"]
