"""`bench locks --quick` writes a JSON report with its machine and every row, and a PNG chart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.bench import locks_bench, matrix, report

REPO_ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {
    "name", "group", "kind", "fence", "note", "pair_us", "pairs_per_s_1", "pairs_per_s_n",
    "pairs_per_s_contended", "refused_free_key", "wake", "errors",
}  # fmt: skip


def bench_locks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobfence", "bench", "locks", "--quick", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bench_locks_quick_writes_a_json_report_and_a_png_chart(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "locks.json", tmp_path / "locks.png"
    done = bench_locks("--only", "memory,redis", "--json", str(out_json), "--png", str(out_png))
    assert done.returncode == 0, done.stderr
    document = json.loads(out_json.read_text())
    assert document["bench"] == "locks" and document["schema"] == report.SCHEMA
    machine = document["machine"]
    assert machine["cores"] >= 1 and machine["python"] and machine["date"].endswith("Z")
    assert "redis" in machine["versions"]
    section = document["results"]["backends"]
    assert section["settings"]["clients"] == 2 and section["skipped"] == {}
    rows = {row["name"]: row for row in section["rows"]}
    assert set(rows) == {"jobfence memory (in-process)", "jobfence Redis"}
    redis_row = rows["jobfence Redis"]
    assert set(redis_row) == ROW_KEYS and redis_row["errors"] == []
    assert 0 < redis_row["pair_us"]["p10"] <= redis_row["pair_us"]["median"]
    assert redis_row["pair_us"]["median"] <= redis_row["pair_us"]["p90"]
    for column in ("pairs_per_s_1", "pairs_per_s_n", "pairs_per_s_contended"):
        assert redis_row[column]["median"] > 0, column
    assert redis_row["wake"]["n"] == 3 and redis_row["wake"]["median_ms"] > 0
    assert rows["jobfence memory (in-process)"]["wake"]["n"] == 0  # no wake across processes
    (async_row,) = section["asyncio_rows"]  # beside the sync row, on the same server
    assert async_row["name"] == "jobfence Redis, asyncio (AsyncLocker)"
    assert async_row["errors"] == [] and async_row["coroutines"] == 100
    assert 0 < async_row["pair_us"]["p10"] <= async_row["pair_us"]["median"]
    assert async_row["pairs_per_s_coroutines"]["median"] > 0
    assert "jobfence Redis" in done.stdout and "PNG written" in done.stderr
    assert "jobfence Redis, asyncio (AsyncLocker)" in done.stdout
    assert out_png.stat().st_size > 0 and report.is_png(out_png)


def test_the_readme_table_is_rendered_from_a_report_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = {
        "name": "jobfence Redis", "group": "redis", "kind": "jobfence", "fence": True, "note": "",
        "pair_us": {"median": 120.0, "p10": 100.0, "p90": 150.0, "p99": 300.0},
        "pairs_per_s_1": {"median": 8000.0, "min": 7000.0, "max": 9000.0},
        "pairs_per_s_n": {"median": 15000.0, "min": 14000.0, "max": 16000.0},
        "pairs_per_s_contended": None, "refused_free_key": 0, "errors": [],
        "wake": {"n": 3, "median_ms": 0.9, "p10_ms": 0.8, "p90_ms": 1.2, "max_ms": 1.3},
    }  # fmt: skip
    section = {"settings": {"clients": 8}, "rows": [row], "skipped": {"etcd": "no binary"}}
    written = report.write_report(
        "locks", {"backends": section}, json_path=tmp_path / "r.json", quiet=True
    )
    assert written.json_path is not None and written.png_path is None
    assert locks_bench.main(["--markdown-from", str(written.json_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| backend | pair µs") and "8 clients" in table[0]
    assert table[2] == "| jobfence Redis | 120 (100-150) | 0.9 (0.8-1.2) | 8000 | 15000 | - | yes |"
    assert table[3].startswith("| etcd: skipped, no binary |")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{matrix.README_BEGIN}\nold table\n{matrix.README_END}\nrest\n")
    args = ["--markdown-from", str(written.json_path), "--readme", str(readme)]
    assert locks_bench.main(args) == 0
    text = readme.read_text()
    assert "old table" not in text and table[2] in text
    assert text.startswith("intro\n") and text.endswith(f"{matrix.README_END}\nrest\n")


def test_a_missing_server_binary_skips_its_backends_with_the_reason() -> None:
    skipped: dict[str, str] = {}
    wanted = ["memory", "redis", "redis-py", "redlock", "pottery"]
    with matrix.servers(wanted, skipped, redis_server="no-such-redis-server", quiet=True) as got:
        assert [c.name for c in got] == ["jobfence memory (in-process)"]
    assert set(skipped) == {"redis", "redis-py", "redlock", "pottery"}
    assert all("'no-such-redis-server' is not on PATH" in why for why in skipped.values())


def test_bench_locks_rejects_an_unknown_backend_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        locks_bench.parse_args(["--only", "redis,mongo"])
    assert "--only: unknown backend(s) mongo" in capsys.readouterr().err
    assert locks_bench.parse_args(["--quick"]).groups == list(matrix.GROUPS)
