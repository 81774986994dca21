"""Memory and server-CPU benchmark: what each finished job leaves in Redis, and what it costs.

On a private redis-server, N jobs of a trivial @singleton_task run through the real task
layer (called as a worker's tracer calls it: binding, key, fingerprint, executor, begin,
commit). The report says, per finished job:
  keys       how many keys the job left behind, by family (`<prefix>:<family>:...`)
  bytes      MEMORY USAGE of those keys, and the INFO memory used_memory delta (which adds
             the key tables' buckets and the expiry entries)
  server µs  INFO commandstats usec of the commands the client sent (EVALSHA: begin and
             commit; the commands inside a script are part of its usec), and the server
             process's CPU (INFO cpu, which adds reading and writing the sockets)
  keeper     the server µs of one lease's extension inside a batched extend_many: a job
             adds one per TTL/3 it runs
The decision log's writer is flushed before each snapshot, so what it keeps counts: a job
that runs leaves no stream of its own, only an entry in the fleet's index stream, capped at
`decision_log_total` entries (reported apart: its bytes stop growing at the cap). The
per-job target counts it too: the index's whole size at the end of the run spread over the
run's jobs (issue 33: over 100,000 jobs, the index at its cap).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from typing import Any

import redis
from celery import Celery

from devstack.bench.gate_bench import as_worker_calls
from devstack.redis_server import RedisServer
from jobfence.config import Settings
from jobfence.locks import Lease, RedisBackend
from jobfence.tasks import install, singleton_task

PREFIX = "jobfence"
TASK_NAME = "shop.tasks.charge_payment"  # a realistic name: it is part of every key
SECRET = "memory-bench-secret-not-for-production"
TARGET_BYTES = 250  # per finished job, plus its stored result
KEEPER_LEASES = 1000


class MemoryBenchError(RuntimeError):
    """The benchmark could not run, or a job did not do what it must."""


def charge(payment_id: int, result_bytes: int = 2) -> str:
    """The job: returns a result of the requested size (its JSON is stored in the record)."""
    return str(payment_id).rjust(result_bytes, "0")[:result_bytes]


def _snapshot(admin: redis.Redis) -> dict[str, Any]:
    cpu = admin.info("cpu")
    return {
        "dbsize": int(admin.dbsize()),
        "used_memory": int(admin.info("memory")["used_memory"]),
        "commandstats": dict(admin.info("commandstats")),
        "cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "keys": set(admin.scan_iter(count=1000)),
    }


def _command_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, int]]:
    out = {}
    for name, stat in after.items():
        old = before.get(name, {"calls": 0, "usec": 0})
        calls = int(stat["calls"]) - int(old["calls"])
        if calls:
            out[name.removeprefix("cmdstat_")] = {
                "calls": calls, "usec": int(stat["usec"]) - int(old["usec"]),
            }  # fmt: skip
    return out


def _family(name: str) -> str:
    parts = name.split(":")
    return parts[1] if len(parts) > 2 and parts[0] == PREFIX else name


def run_jobs(url: str, jobs: int, result_bytes: int) -> dict[str, Any]:
    """Run `jobs` new jobs through the task layer; measure what they left and cost."""
    settings = Settings(lock_url=url, key_prefix=PREFIX, key_secret=SECRET)
    app = Celery("mbench", set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"])
    runtime = install(app, settings)
    singleton_task(app=app, name=TASK_NAME)(charge)
    app.finalize()
    task = app.tasks[TASK_NAME]
    admin = redis.Redis.from_url(url, decode_responses=True)
    try:
        for n in range(20):  # warm-up: connections, scripts; their keys count as "before"
            as_worker_calls(task, (-1 - n, result_bytes))
        flush = runtime.executor.recorder.flush if runtime.executor.recorder else lambda: None
        flush()  # the decision log's index exists before: its growth is measured apart
        index = runtime.backend.keys.decision_index()  # type: ignore[attr-defined]
        index_before = int(admin.memory_usage(index, samples=0) or 0)
        before = _snapshot(admin)
        started = time.perf_counter()
        for n in range(jobs):
            if as_worker_calls(task, (n, result_bytes)) != charge(n, result_bytes):
                raise MemoryBenchError("a job did not return its body's result")
        wall = time.perf_counter() - started
        flush()  # every decision of the run stored, as the writer thread would
        index_after = int(admin.memory_usage(index, samples=0) or 0)
        after = _snapshot(admin)
        new = sorted(after["keys"] - before["keys"])
        with admin.pipeline(transaction=False) as pipe:
            for name in new:
                pipe.memory_usage(name, samples=0)
            usage = [int(u or 0) for u in pipe.execute()]
        families = Counter(_family(n) for n in new)
        bytes_by_family: Counter[str] = Counter()
        for name, used in zip(new, usage, strict=True):
            bytes_by_family[_family(name)] += used
        record = next((n for n in new if _family(n) == "job"), None)
        record_bytes = [u for n, u in zip(new, usage, strict=True) if _family(n) == "job"]
        encoding = str(admin.object("encoding", record)) if record else ""
        kind = str(admin.type(record)) if record else ""
        key, _ = task.identity((0, result_bytes), {})
        stored = runtime.backend.job_record(key)
        result_len = len(stored.result) if stored is not None else 0
        commands = _command_delta(before["commandstats"], after["commandstats"])
        # What the client sent: EVALSHA (its usec holds the commands its script ran).
        sent = {c: v for c, v in commands.items() if c in ("evalsha", "eval")}
        server_usec = sum(v["usec"] for v in sent.values())
        return {
            "jobs": jobs,
            "wall_seconds": wall,
            "keys_per_job": (after["dbsize"] - before["dbsize"]) / jobs,
            "keys_by_family": dict(families),
            "memory_usage_per_job": sum(usage) / jobs,
            "memory_usage_by_family_per_job": {f: b / jobs for f, b in bytes_by_family.items()},
            "record_key_bytes_min": min(record_bytes, default=0),
            "record_key_bytes_max": max(record_bytes, default=0),
            "record_example_name_length": len(record or ""),
            "record_type": f"{kind} ({encoding})",
            "result_length": result_len,
            "used_memory_delta_per_job": (after["used_memory"] - before["used_memory"]) / jobs,
            "decision_index_bytes_per_job": (index_after - index_before) / jobs,
            "decision_index_bytes": index_after,
            "memory_usage_per_job_with_index": (sum(usage) + index_after) / jobs,
            "decision_index_entries": int(admin.xlen(index)) if admin.exists(index) else 0,
            "decision_log_total": settings.decision_log_total,
            "commands": commands,
            "server_usec_per_job": server_usec / jobs,
            "script_calls_per_job": sum(v["calls"] for v in sent.values()) / jobs,
            "server_cpu_usec_per_job": (after["cpu"] - before["cpu"]) * 1e6 / jobs,
        }
    finally:
        admin.close()
        runtime.close()


def keeper_cost(url: str, leases: int = KEEPER_LEASES, rounds: int = 5) -> dict[str, Any]:
    """Server µs of one lease's extension, from `rounds` batched extend_many of `leases`."""
    backend = RedisBackend.from_url(url, prefix="mbench-keeper")
    admin = redis.Redis.from_url(url, decode_responses=True)
    try:
        held = [backend.try_acquire(f"keeper:{i}", 60.0) for i in range(leases)]
        if not all(isinstance(le, Lease) for le in held):
            raise MemoryBenchError("a free key was refused")
        kept = [le for le in held if le is not None]
        backend.extend_many(kept[:1])  # the script is loaded
        before = dict(admin.info("commandstats"))
        for _ in range(rounds):
            if not all(backend.extend_many(kept)):
                raise MemoryBenchError("an extension of a held lease was refused")
        commands = _command_delta(before, dict(admin.info("commandstats")))
        evalsha = commands.get("evalsha", {"calls": 0, "usec": 0})
        for lease in kept:
            lease.release()
        return {
            "leases": leases,
            "rounds": rounds,
            "scripts_per_round": evalsha["calls"] / rounds,
            "usec_per_lease": evalsha["usec"] / (rounds * leases),
        }
    finally:
        admin.close()
        backend.close()


def build_report(url: str, server_version: str, jobs: dict[str, Any],
                 keeper: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    per_job = jobs["memory_usage_per_job_with_index"]
    bound = TARGET_BYTES + jobs["result_length"]
    return {
        "bench": "memory",
        "server": url,
        "redis_version": server_version,
        "python": platform.python_version(),
        "jobs": jobs,
        "keeper": keeper,
        "targets": {
            "one_key_per_job": jobs["keys_per_job"] <= 1.0,
            f"at_most_{TARGET_BYTES}_bytes_plus_result": per_job <= bound,
        },
        "decision_index_at_cap": jobs["decision_index_entries"] >= jobs["decision_log_total"],
    }


def format_report(report: dict[str, Any]) -> str:
    j, k = report["jobs"], report["keeper"]
    families = ", ".join(
        f"{f}: {n} keys, {j['memory_usage_by_family_per_job'][f]:.0f} B/job"
        for f, n in sorted(j["keys_by_family"].items())
    )
    lines = [
        f"memory bench: {j['jobs']} finished jobs of {TASK_NAME} through the task layer "
        f"(redis {report['redis_version']}, python {report['python']})",
        "",
        f"  keys per finished job        {j['keys_per_job']:.3f}   ({families})",
        f"  record                       {j['record_type']}, key name "
        f"{j['record_example_name_length']} chars, result {j['result_length']} chars",
        f"  MEMORY USAGE per job         {j['memory_usage_per_job']:.1f} B   (record key "
        f"{j['record_key_bytes_min']}..{j['record_key_bytes_max']} B; target <= "
        f"{TARGET_BYTES} + result = {TARGET_BYTES + j['result_length']} B)",
        f"  used_memory delta per job    {j['used_memory_delta_per_job']:.1f} B   (adds the "
        "key table's buckets, the expiry entry and the decision index's growth)",
        f"  decision index, per job      {j['decision_index_bytes_per_job']:.1f} B   (one "
        f"stream for the fleet, {j['decision_index_entries']} entries, capped at "
        f"{j['decision_log_total']}: it stops growing there)",
        f"  decision index, whole        {j['decision_index_bytes']:,} B   ("
        + ("at its cap" if report["decision_index_at_cap"] else "below its cap")
        + f"); spread over the {j['jobs']:,} jobs: "
        f"{j['decision_index_bytes'] / j['jobs']:.1f} B/job",
        f"  per job, index included      {j['memory_usage_per_job_with_index']:.1f} B   (the "
        f"target: <= {TARGET_BYTES} + result = {TARGET_BYTES + j['result_length']} B)",
        "",
        f"  server usec per job          {j['server_usec_per_job']:.1f}   (INFO commandstats: "
        f"{j['script_calls_per_job']:.2f} script calls per job, begin + commit)",
        f"  server CPU usec per job      {j['server_cpu_usec_per_job']:.1f}   (INFO cpu: adds "
        "socket reads and writes)",
        f"  keeper: per lease extension  {k['usec_per_lease']:.2f} usec   ({k['leases']} "
        f"leases per extend_many, {k['scripts_per_round']:.0f} script(s) per call); a job "
        "adds one per TTL/3 it runs",
        "",
        "  commands (calls / usec per call):",
    ]
    for name, v in sorted(j["commands"].items(), key=lambda kv: -kv[1]["usec"]):
        lines.append(f"    {name:<12} {v['calls']:>8}  {v['usec'] / v['calls']:8.2f}")
    lines += ["", "  targets: " + ", ".join(
        f"{name} {'met' if ok else 'MISSED'}" for name, ok in report["targets"].items())]
    lines += [
        "",
        "  A finished job keeps one string key, jobfence:job:{<task>:<hmac>}, for result_ttl:",
        "  '<D|F><fence>,<ms from grant to finish>,<len>:<fingerprint><result JSON>'. Fences",
        "  come from one key per server (per slot on a cluster), <prefix>:fences, the highest",
        "  fence granted, not from a counter per job key kept for fence_retention (30 days):",
        "  until this version a job also left <prefix>:fence:{<key>} and its record was a hash",
        "  with five named fields.",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobfence bench memory",
        description="Keys, bytes and server CPU per finished job on a private redis-server.",
    )
    p.add_argument("--jobs", type=int, default=100_000,
                   help="finished jobs (default 100000: the index reaches its cap)")  # fmt: skip
    p.add_argument("--result-bytes", type=int, default=2,
                   help="length of each job's result string (default 2)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.result_bytes < 1:
        p.error("--jobs and --result-bytes must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with RedisServer(executable=args.redis_server) as server:
        version = str(server.client().info("server")["redis_version"])
        jobs = run_jobs(server.url, args.jobs, args.result_bytes)
        keeper = keeper_cost(server.url)
        report = build_report(server.url, version, jobs, keeper)
    print(json.dumps(report) if args.json else format_report(report))
    if args.check and not all(report["targets"].values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
