"""`bench locks --quick` writes a JSON report with its machine and every row, and a PNG chart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jobfence.worker.bench import locks_bench, report

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
    assert "jobfence Redis" in done.stdout and "PNG written" in done.stderr
    assert out_png.stat().st_size > 0 and report.is_png(out_png)
    # The README's table is rendered from this file, not typed.
    table = subprocess.run(
        [sys.executable, "-m", "jobfence", "bench", "locks", "--markdown-from", str(out_json)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert table.startswith("| backend |") and "| jobfence Redis |" in table


def test_a_missing_server_binary_skips_its_backends_with_the_reason(tmp_path: Path) -> None:
    done = bench_locks("--only", "memory,redis,redis-py", "--redis-server", "no-such-redis-server",
                       "--out-dir", str(tmp_path), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    skipped = results["backends"]["skipped"]
    assert set(skipped) == {"redis", "redis-py"}
    assert "no-such-redis-server" in skipped["redis"]
    assert [r["name"] for r in results["backends"]["rows"]] == ["jobfence memory (in-process)"]
    (written,) = tmp_path.glob("locks-*.json")  # the default name under --out-dir
    assert report.load(written)["results"]["backends"]["skipped"] == skipped


def test_bench_locks_rejects_an_unknown_backend_by_name() -> None:
    done = bench_locks("--only", "redis,mongo")
    assert done.returncode == 2 and "--only: unknown backend(s) mongo" in done.stderr
    assert locks_bench.parse_args(["--quick"]).groups == list(locks_bench.matrix.GROUPS)
