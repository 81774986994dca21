"""Server cost per lock operation: INFO commandstats µs per call, jobfence beside redis-py Lock.

What bounds one Redis at saturation is the server's time per operation, not the client's
round trip. On a private redis-server each case runs N operations on N distinct keys (the
acquires, then the releases), with the command statistics reset before each phase; the
report gives the server µs per operation of the commands the client sent (a script's µs
holds the commands it ran, which are listed apart as its inner commands). The statistics
are wall time inside the server, so a loaded machine inflates them: rounds are interleaved
and the median is reported, with the ratios taken per round.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Callable
from typing import Any

import redis

from devstack.bench import report as report_io
from jobfence.locks import Lease, LockError, RedisBackend

PAIR_TARGET = 1.9  # a jobfence pair's server time over redis-py Lock's
JOB_TARGET = 1.3  # a job's begin + commit over a jobfence pair
TTL = 30.0
#: (case, phase, the commands its client sends): the rest are a script's inner commands.
PHASES = (
    ("redis-py Lock", "acquire", ("set",)),
    ("redis-py Lock", "release", ("evalsha",)),
    ("jobfence lock", "acquire", ("evalsha",)),
    ("jobfence lock", "release", ("evalsha",)),
    ("jobfence job", "begin", ("evalsha",)),
    ("jobfence job", "commit", ("evalsha",)),
)


class ServerBenchError(RuntimeError):
    """The benchmark could not run, or an operation did not do what it must."""


def _stats(admin: redis.Redis) -> dict[str, tuple[int, int]]:
    raw: dict[str, dict[str, Any]] = admin.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in raw.items()
    }


class Cases:
    """The operations of one round, on fresh keys each round."""

    def __init__(self, url: str, ops: int) -> None:
        self.ops = ops
        self.client = redis.Redis.from_url(url, decode_responses=True, health_check_interval=0)
        self.backend = RedisBackend.from_url(url, prefix="sbench")
        self.round = 0
        self.rp_locks: list[Any] = []
        self.leases: list[Lease] = []
        self.jobs: list[Lease] = []

    def close(self) -> None:
        self.backend.close()
        self.client.close()

    def phase(self, case: str, phase: str) -> Callable[[], None]:
        return {
            ("redis-py Lock", "acquire"): self.rp_acquire,
            ("redis-py Lock", "release"): self.rp_release,
            ("jobfence lock", "acquire"): self.jf_acquire,
            ("jobfence lock", "release"): self.jf_release,
            ("jobfence job", "begin"): self.job_begin,
            ("jobfence job", "commit"): self.job_commit,
        }[case, phase]

    def rp_acquire(self) -> None:
        self.rp_locks = [self.client.lock(f"rp:{self.round}:{i}", timeout=TTL)
                         for i in range(self.ops)]  # fmt: skip
        for lock in self.rp_locks:
            if not lock.acquire(blocking=False):
                raise ServerBenchError("redis-py Lock refused a free key")

    def rp_release(self) -> None:
        for lock in self.rp_locks:
            lock.release()

    def jf_acquire(self) -> None:
        self.leases = []
        for i in range(self.ops):
            lease = self.backend.try_acquire(f"jf:{self.round}:{i}", TTL)
            if lease is None:
                raise ServerBenchError("jobfence refused a free key")
            self.leases.append(lease)

    def jf_release(self) -> None:
        for lease in self.leases:
            if not lease.release():
                raise ServerBenchError("a jobfence release found another owner")

    def job_begin(self) -> None:
        self.jobs = []
        for i in range(self.ops):
            got = self.backend.begin(f"job:{self.round}:{i}", TTL, record=True, fingerprint="fp")
            if not isinstance(got, Lease):
                raise ServerBenchError(f"begin refused a new job: {got!r}")
            self.jobs.append(got)

    def job_commit(self) -> None:
        for lease in self.jobs:
            if not self.backend.commit(lease, state="DONE", result="1", fingerprint="fp",
                                       result_ttl=600):  # fmt: skip
                raise ServerBenchError("commit found another owner")


def run(url: str, *, ops: int, rounds: int) -> dict[str, Any]:
    admin = redis.Redis.from_url(url, decode_responses=True)
    cases = Cases(url, ops)
    per: dict[tuple[str, str], list[float]] = {(c, p): [] for c, p, _ in PHASES}
    inner: dict[tuple[str, str], dict[str, list[float]]] = {(c, p): {} for c, p, _ in PHASES}
    try:
        cases.round = -1  # warm-up: scripts loaded, connections open
        for case, phase, _ in PHASES:
            cases.phase(case, phase)()
        for r in range(rounds):
            cases.round = r
            order = [(c, p, s) for c, p, s in PHASES]
            # Rotate whole cases (an acquire stays before its release) so drift hits all.
            names = list(dict.fromkeys(c for c, _, _ in order))
            shift = r % len(names)
            names = names[shift:] + names[:shift]
            for name in names:
                for case, phase, sent in (x for x in order if x[0] == name):
                    admin.config_resetstat()
                    cases.phase(case, phase)()
                    stats = _stats(admin)
                    calls = sum(stats.get(s, (0, 0))[0] for s in sent)
                    if calls < ops:
                        raise ServerBenchError(f"{case} {phase}: {calls} calls for {ops} ops")
                    per[case, phase].append(sum(stats.get(s, (0, 0))[1] for s in sent) / ops)
                    for cmd, (n, usec) in stats.items():
                        if cmd in sent or cmd in ("config", "info") or n < ops // 2:
                            continue
                        inner[case, phase].setdefault(cmd, []).append(usec / ops)
    finally:
        cases.close()
        admin.close()
    return {"per": per, "inner": inner}


def build_report(url: str, version: str, got: dict[str, Any], *, ops: int, rounds: int
                 ) -> dict[str, Any]:  # fmt: skip
    per: dict[tuple[str, str], list[float]] = got["per"]

    def pair(case: str, a: str, b: str) -> list[float]:
        return [x + y for x, y in zip(per[case, a], per[case, b], strict=True)]

    rp = pair("redis-py Lock", "acquire", "release")
    jf = pair("jobfence lock", "acquire", "release")
    job = pair("jobfence job", "begin", "commit")
    pair_ratio = statistics.median(j / r for j, r in zip(jf, rp, strict=True))
    job_ratio = statistics.median(j / p for j, p in zip(job, jf, strict=True))
    rows = [
        {
            "case": case,
            "op": phase,
            "usec": round(statistics.median(per[case, phase]), 2),
            "usec_min": round(min(per[case, phase]), 2),
            "inner": {
                cmd: round(statistics.median(v), 2)
                for cmd, v in sorted(got["inner"][case, phase].items(), key=lambda kv: -sum(kv[1]))
            },
        }
        for case, phase, _ in PHASES
    ]
    return {
        "server": {"url": url, "redis_version": version},
        "python": platform.python_version(),
        "versions": {"redis-py": redis.__version__},
        "config": {"ops_per_phase": ops, "rounds": rounds},
        "rows": rows,
        "pairs_usec": {
            "redis-py Lock": round(statistics.median(rp), 2),
            "jobfence lock": round(statistics.median(jf), 2),
            "jobfence job": round(statistics.median(job), 2),
        },
        "pair_ratio": round(pair_ratio, 3),
        "job_ratio": round(job_ratio, 3),
        "targets": {
            f"pair_within_{PAIR_TARGET}x_redis_py": pair_ratio <= PAIR_TARGET,
            f"job_within_{JOB_TARGET}x_pair": job_ratio <= JOB_TARGET,
        },
    }


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    out = [
        "jobfence server cost per lock operation (INFO commandstats)",
        f"  server  private redis-server {report['server']['redis_version']} at "
        f"{report['server']['url']}; python {report['python']}, "
        f"redis-py {report['versions']['redis-py']}",
        "",
        f"{cfg['ops_per_phase']} operations on distinct keys per phase, median of "
        f"{cfg['rounds']} interleaved rounds; µs: the sent commands' server time per operation",
        "",
        f"  {'case':<16} {'op':<8} {'µs':>6} {'(min)':>7}  inner commands (µs per op)",
    ]
    for r in report["rows"]:
        inner = ", ".join(f"{k} {v:.2f}" for k, v in r["inner"].items()) or "-"
        out.append(
            f"  {r['case']:<16} {r['op']:<8} {r['usec']:>6.2f} {r['usec_min']:>7.2f}  {inner}"
        )
    p = report["pairs_usec"]
    t = report["targets"]
    out += [
        "",
        f"pair (acquire + release): redis-py Lock {p['redis-py Lock']:.2f} µs, jobfence "
        f"{p['jobfence lock']:.2f} µs ({report['pair_ratio']:.2f}x); job begin + commit "
        f"{p['jobfence job']:.2f} µs ({report['job_ratio']:.2f}x the jobfence pair)",
        "",
        "targets",
        f"  jobfence pair within {PAIR_TARGET}x redis-py Lock's: {report['pair_ratio']:.2f}x  "
        f"{'MET' if t[f'pair_within_{PAIR_TARGET}x_redis_py'] else 'MISSED'}",
        f"  job begin + commit within {JOB_TARGET}x the pair: {report['job_ratio']:.2f}x  "
        f"{'MET' if t[f'job_within_{JOB_TARGET}x_pair'] else 'MISSED'}",
    ]
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobfence bench server",
        description="Redis server time per lock operation: jobfence beside redis-py Lock.",
    )
    p.add_argument("--ops", type=int, default=3000, help="operations per phase (3000)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    report_io.add_private_redis_args(p)
    args = p.parse_args(argv)
    for name in ("ops", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if --check and a target is missed, 2 on failure."""
    args = parse_args(argv)

    def measure(url: str, version: str) -> dict[str, Any]:
        got = run(url, ops=args.ops, rounds=args.rounds)
        return build_report(url, version, got, ops=args.ops, rounds=args.rounds)

    return report_io.main_on_private_redis("server", args, measure, format_report,
                                           errors=(ServerBenchError, LockError))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
