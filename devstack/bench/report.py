"""Where every `jobfence bench` subcommand writes its results: one JSON file and one PNG chart.

The API every bench uses (locks, celery, gate, and any later one):

    parser = argparse.ArgumentParser(...)
    report.add_output_args(parser)            # --json [PATH], --png PATH, --out-dir, --no-save
    ...
    results = {...}                           # anything JSON can hold
    report.write_report("locks", results, png=draw_chart, args=args)

A bench on a private redis-server hands its measuring to `main_on_private_redis`, which starts
the server, prints the report (or its JSON), writes the files and applies `--check`.

`png` is a callable `(results, path) -> None` that draws the chart with matplotlib; it is
called only if matplotlib imports, so a bench runs without it (the PNG is then skipped with
an install hint). The JSON file holds `{"bench", "machine", "results"}`; `machine` records
the cores, CPU, Python, OS, the versions of the packages that matter and the UTC date.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DIR = "bench-results"
STDOUT = "-"  # `--json` with no path: print the JSON to stdout instead of the text report
SCHEMA = 1
PACKAGES = (
    "jobfence",
    "redis",
    "hiredis",
    "celery",
    "kombu",
    "sqlalchemy",
    "psycopg",
    "pymysql",
    "kazoo",
    "python-redis-lock",
    "pottery",
    "celery-once",
    "celery-singleton",
    "matplotlib",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

Chart = Callable[[Mapping[str, Any], Path], None]


@dataclass(frozen=True)
class Written:
    """What `write_report` wrote: None where a file was not written (and why in `notes`)."""

    json_path: Path | None
    png_path: Path | None
    notes: tuple[str, ...]


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """The output options every bench subcommand shares."""
    parser.add_argument(
        "--json",
        nargs="?",
        const=STDOUT,
        default=None,
        metavar="PATH",
        help=f"write the results as JSON to PATH (default {DEFAULT_DIR}/<bench>-<UTC time>.json); "
        "with no PATH, print the JSON on stdout instead of the text report",
    )
    parser.add_argument(
        "--png",
        default=None,
        metavar="PATH",
        help=f"write the chart to PATH (default {DEFAULT_DIR}/<bench>-<UTC time>.png; "
        "needs matplotlib: pip install 'jobfence[bench]')",
    )
    parser.add_argument(
        "--out-dir",
        default=DEFAULT_DIR,
        metavar="DIR",
        help=f"where default file names go (default ./{DEFAULT_DIR})",
    )
    parser.add_argument(
        "--no-save", action="store_true", help="write no JSON or PNG file, only print"
    )


def add_private_redis_args(parser: argparse.ArgumentParser) -> None:
    """The options of a bench on a private redis-server (`main_on_private_redis`): the output
    options, `--check` and `--redis-server`."""
    add_output_args(parser)
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument("--redis-server", default="redis-server", help="redis-server executable")


def json_to_stdout(args: argparse.Namespace) -> bool:
    """True when `--json` was given without a path: the JSON replaces the text report."""
    return bool(getattr(args, "json", None) == STDOUT)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """The machine and software a result was measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    versions = {p: v for p in PACKAGES if (v := _version(p)) is not None}
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cores": os.cpu_count() or 1,
        "cpu": cpu,
        "load_average": load,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "versions": versions,
    }


def default_path(name: str, suffix: str, out_dir: str | Path = DEFAULT_DIR) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path(out_dir) / f"{name}-{stamp}{suffix}"


def write_report(
    name: str,
    results: Mapping[str, Any],
    png: Chart | None = None,
    *,
    args: argparse.Namespace | None = None,
    json_path: str | Path | None = None,
    png_path: str | Path | None = None,
    out_dir: str | Path | None = None,
    quiet: bool = False,
) -> Written:
    """Write `results` of bench `name` as JSON and, if `png` is given, as a PNG chart.

    Paths come from the keywords, else from `args` (see `add_output_args`), else default
    to `<out_dir>/<name>-<UTC time>.json|.png`. With `args.no_save` nothing is written.
    A note is printed (to stderr, unless `quiet`) for each file written or skipped.
    """
    if args is not None:
        if args.no_save:
            return Written(None, None, ("no files written (--no-save)",))
        if json_path is None and args.json not in (None, STDOUT):
            json_path = args.json
        png_path = png_path if png_path is not None else args.png
        out_dir = out_dir if out_dir is not None else args.out_dir
    base = Path(out_dir if out_dir is not None else DEFAULT_DIR)
    jpath = Path(json_path) if json_path is not None else default_path(name, ".json", base)
    jpath.parent.mkdir(parents=True, exist_ok=True)
    document = {"bench": name, "schema": SCHEMA, "machine": machine_info(), "results": results}
    jpath.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
    notes = [f"JSON written to {jpath}"]
    ppath: Path | None = None
    if png is not None:
        ppath = Path(png_path) if png_path is not None else jpath.with_suffix(".png")
        try:
            import matplotlib

            matplotlib.use("Agg")  # no display: write files only
        except ImportError:
            notes.append("PNG skipped: matplotlib is missing (pip install 'jobfence[bench]')")
            ppath = None
        else:
            ppath.parent.mkdir(parents=True, exist_ok=True)
            png(results, ppath)
            notes.append(f"PNG written to {ppath}")
    if not quiet:
        for note in notes:
            print(f"bench {name}: {note}", file=sys.stderr)
    return Written(jpath, ppath, tuple(notes))


def is_png(path: Path) -> bool:
    """The file exists, is not empty and starts with the PNG signature."""
    try:
        with open(path, "rb") as f:
            return f.read(len(PNG_MAGIC)) == PNG_MAGIC
    except OSError:
        return False


def load(path: str | Path) -> dict[str, Any]:
    """A report written by `write_report`."""
    document: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
    if "results" not in document or "bench" not in document:
        raise ValueError(f"{path}: not a jobfence bench report (no 'bench'/'results' keys)")
    return document


def main_on_private_redis(
    name: str,
    args: argparse.Namespace,
    measure: Callable[[str, str], dict[str, Any]],
    format_report: Callable[[dict[str, Any]], str],
    *,
    errors: tuple[type[Exception], ...] = (),
    png: Chart | None = None,
) -> int:
    """The `main` of a bench on a private redis-server (`args.redis_server`): `measure(url,
    version)` gives the report, printed as text (or JSON for `--json` alone) and written as
    files. 0 on success, 1 if `--check` and a target is missed, 2 if the server cannot start
    or `measure` raises one of `errors` (said in one line on stderr)."""
    import redis

    from devstack.redis_server import RedisServer

    caught: tuple[type[Exception], ...] = (redis.RedisError, *errors)
    try:
        server = RedisServer(executable=args.redis_server).start()
    except RuntimeError as exc:
        print(f"bench: cannot start a private redis-server: {exc}", file=sys.stderr)
        return 2
    try:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        try:
            version = str(admin.info("server")["redis_version"])
        finally:
            admin.close()
        if not json_to_stdout(args):
            print(f"running on private redis-server {version} at {server.url} ...", flush=True)
        report = measure(server.url, version)
    except caught as exc:
        print(f"bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        server.stop()
    print(json.dumps(report) if json_to_stdout(args) else format_report(report))
    write_report(name, report, png=png, args=args)
    if getattr(args, "check", False) and not all(report["targets"].values()):
        return 1
    return 0
