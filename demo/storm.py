"""`python -m jobfence demo`: a real fleet works through a storm of duplicate, retried and
crashed jobs, and a report checked against the ledger proves nothing took effect twice."""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import redis
from sqlalchemy import Engine, func, select

from demo import journal as journal_mod
from demo.app import create_shop_app
from demo.embedded import EmbeddedStack
from demo.fleet import Fleet, FleetOptions
from demo.shop.ledger import (
    accounts,
    create_schema,
    open_account,
    payments,
    reservations,
    seed_stock,
)
from demo.shop.ledger import stock as stock_table
from devstack import procs
from devstack.redis_server import RedisServer, RedisServerError
from jobfence.config import Settings, UnsafeSettings, load_settings
from jobfence.config.schemes import backend_schemes
from jobfence.config.settings import ENV_PREFIX
from jobfence.tasks.effects import jobs as jobs_table
from jobfence.tasks.effects import make_engine

CURRENCY = "EUR"
DEMO_TTL = 3.0  # short, so a frozen worker outlives its leases within seconds
VISIBILITY_TIMEOUT = 10.0
MAX_COUNTDOWN = 5.0
LOCK_OUTAGE = DEMO_TTL  # seconds the lock server stays down: running leases run out


@dataclass(frozen=True)
class DemoOptions:
    workers: int = 3
    concurrency: int = 2
    jobs: int = 300
    publishes: int = 2000
    seed: int = 7
    broker: str | None = None
    lock_backend: str | None = None
    database: str | None = None
    fail_rate: float = 0.1
    timeout: float = 300.0
    chaos: bool = True


@dataclass(frozen=True)
class Job:
    """One distinct job of the storm: a charge or a reservation, and how it is published."""

    task: str
    args: tuple[Any, ...]
    business_id: str


@dataclass
class Storm:
    jobs: list[Job]
    publishes: list[tuple[Job, float | None]]  # (job, countdown)
    balances: dict[str, int]
    levels: dict[str, int]


@dataclass
class Report:
    published: int = 0
    distinct_jobs: int = 0
    payments: int = 0
    orders: int = 0
    executions: int = 0
    duplicates_suppressed: int = 0
    deferred_redeliveries: int = 0
    retries: int = 0
    stale_writes_refused: int = 0
    superseded: int = 0
    charged: int = 0
    declined: int = 0
    reserved: int = 0
    refused: int = 0
    effects_per_job_min: int = 0
    effects_per_job_max: int = 0
    double_effects: int = 0
    double_charges: int = 0
    oversold: int = 0
    lost_jobs: int = 0
    conflicts_refused: int = 0
    conflicts_probed: int = 0
    killed_worker: str = ""
    frozen_worker: str = ""
    frozen_s: float = 0.0
    lock_restarts: int = 0  # lock-server restarts that lost all its data
    lock_restart_at: str = ""  # progress when it happened, e.g. "50%"
    leases_lost: int = 0  # running jobs whose lease went with the lock server's data
    redelivered: int = 0  # deliveries sent again because the job's fate was unknown
    elapsed_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


# -- the storm ---------------------------------------------------------------------------
def plan_storm(opts: DemoOptions) -> Storm:
    """About 2/3 payments over a few accounts and 1/3 orders over a few skus, each job
    published several times, some with countdowns; some accounts and skus run short."""
    rng = random.Random(opts.seed)
    n_pay = max(1, opts.jobs * 2 // 3)
    n_ord = max(1, opts.jobs - n_pay)
    accounts_ = [f"acct-{i:03d}" for i in range(max(2, n_pay // 5))]
    skus = [f"sku-{i:03d}" for i in range(max(2, n_ord // 5))]
    balances = {a: rng.choice([5_000, 20_000, 100_000]) for a in accounts_}
    levels = {s: rng.randint(5, 25) for s in skus}
    jobs = [Job("tasks.payments.charge", (f"pay-{opts.seed}-{i:05d}", rng.choice(accounts_),
                                          rng.randint(100, 5_000), CURRENCY),
                f"pay-{opts.seed}-{i:05d}") for i in range(n_pay)]
    jobs += [Job("tasks.stock.reserve", (f"ord-{opts.seed}-{i:05d}", rng.choice(skus),
                                         rng.randint(1, 4)), f"ord-{opts.seed}-{i:05d}")
             for i in range(n_ord)]
    total = max(opts.publishes, len(jobs))
    copies = [1] * len(jobs)
    for _ in range(total - len(jobs)):
        copies[rng.randrange(len(jobs))] += 1
    publishes: list[tuple[Job, float | None]] = []
    for job, n in zip(jobs, copies, strict=True):
        for _ in range(n):
            delayed = rng.random() < 0.15
            publishes.append((job, round(rng.uniform(0.5, MAX_COUNTDOWN), 2) if delayed else None))
    rng.shuffle(publishes)
    return Storm(jobs, publishes, balances, levels)


# -- progress ------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, out: IO[str]) -> None:
        self.total = max(1, total)
        self.out = out
        self.tty = out.isatty()
        self._last_decile = -1

    def show(self, done: int, note: str = "") -> None:
        frac = min(1.0, done / self.total)
        if self.tty:
            bar = "#" * int(frac * 30)
            self.out.write(f"\r  [{bar:<30}] {done}/{self.total} jobs done {note:<40}")
            self.out.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            self.out.write(f"  {int(frac * 100):3d}% {done}/{self.total} jobs done {note}\n")
            self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")


# -- running -------------------------------------------------------------------------------
def demo_env(opts: DemoOptions, urls: dict[str, str], journal_url: str) -> dict[str, str]:
    p = ENV_PREFIX
    return {
        **urls,
        f"{p}DEFAULT_TTL": str(DEMO_TTL),
        f"{p}SOCKET_TIMEOUT": "0.5",
        f"{p}VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
        f"{p}MAX_COUNTDOWN": str(MAX_COUNTDOWN),
        f"{p}ACQUIRE_TIMEOUT": "5",
        f"{p}KEY_SECRET": secrets.token_hex(16),
        # A fresh secret per run on purpose (throw-away jobs): past the start-up refusal.
        f"{p}KEY_SECRET_RESET": "true",
        f"{p}DEMO_FAIL_RATE": str(opts.fail_rate),
        f"{p}DEMO_DELAY_MIN_MS": "50",
        f"{p}DEMO_DELAY_MAX_MS": "200",
        f"{p}DEMO_SEED": str(opts.seed),
        journal_mod.JOURNAL_ENV: journal_url,
    }


@contextmanager
def servers(
    opts: DemoOptions, say: Callable[[str], None]
) -> Iterator[tuple[dict[str, str], EmbeddedStack | None]]:
    """The JOBFENCE_* URLs to use: the given servers, else an embedded stack of our own
    (returned too, so the chaos can restart its lock server)."""
    p = ENV_PREFIX
    given = {f"{p}LOCK_URL": opts.lock_backend, f"{p}BROKER_URL": opts.broker,
             f"{p}DATABASE_URL": opts.database}
    if opts.lock_backend and opts.broker and opts.database:
        yield {k: v for k, v in given.items() if v}, None
        return
    with EmbeddedStack() as stack:
        say(f"embedded lock redis-server pid {stack.pid} on port {stack.port}, broker "
            f"redis-server pid {stack.broker_server.pid} on port {stack.broker_server.port}; "
            f"ledger {stack.database_path}")
        urls = {**stack.env(), **{k: v for k, v in given.items() if v}}
        yield urls, stack


def journal_url(urls: dict[str, str]) -> str:
    """Where workers count executor events: database 3 of the broker's Redis (it survives
    the lock server's restart), else of the lock server."""
    redis = backend_schemes("redis")
    redis_urls = (f"{redis.plain}://", f"{redis.tls}://")
    for name in (f"{ENV_PREFIX}BROKER_URL", f"{ENV_PREFIX}LOCK_URL"):
        url = urls.get(name, "")
        if url.startswith(redis_urls):
            return url.rsplit("/", 1)[0] + "/3"
    raise UnsafeSettings(f"{ENV_PREFIX}BROKER_URL", "the demo journal needs a Redis server",
                         "use a redis:// broker or lock server")


def settings_from(env: dict[str, str]) -> Settings:
    return load_settings(**{k[len(ENV_PREFIX):].lower(): v for k, v in env.items()
                            if k.startswith(ENV_PREFIX) and not k.startswith(ENV_PREFIX + "DEMO")})


def seed_ledger(engine: Engine, storm: Storm) -> None:
    create_schema(engine)
    for account, balance in storm.balances.items():
        open_account(engine, account, currency=CURRENCY, balance_cents=balance)
    seed_stock(engine, storm.levels)


def done_count(engine: Engine, keys: Sequence[str]) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(jobs_table)
                                .where(jobs_table.c.job_key.in_(list(keys)))).scalar_one())


def queue_idle(broker_url: str) -> bool:
    """No message waiting in the default queue, none delivered and unacknowledged."""
    client = redis.Redis.from_url(broker_url, socket_timeout=2.0)
    try:
        return int(client.llen("celery")) == 0 and int(client.zcard("unacked_index")) == 0
    finally:
        client.close()


class Chaos:
    """SIGKILLs one worker at 20% done; SIGSTOPs another past the TTL at 35%, then resumes it;
    at 50% restarts the (embedded) lock server, which loses every lock, fence and record."""

    def __init__(
        self,
        fleet: Fleet,
        say: Callable[[str], None],
        report: Report,
        lock_server: RedisServer | None = None,
    ) -> None:
        workers = [m for m in fleet.members if m.name.startswith("worker")]
        self.victim = workers[0] if len(workers) >= 3 else None
        self.sleeper = workers[1] if len(workers) >= 3 else None
        self.lock_server = lock_server
        self.say = say
        self.report = report
        self.timer: threading.Timer | None = None
        self.lock_timer: threading.Timer | None = None
        if lock_server is None:
            say("chaos: no lock-server restart (the lock server is not the demo's own)")

    def on_progress(self, frac: float) -> None:
        if self.victim is not None and frac >= 0.2:
            victim, self.victim = self.victim, None
            procs.signal_group(victim.proc, signal.SIGKILL)
            self.report.killed_worker = victim.name
            self.say(f"chaos: SIGKILL {victim.name} (pid {victim.proc.pid}) and its pool")
        if self.sleeper is not None and frac >= 0.35:
            sleeper, self.sleeper = self.sleeper, None
            frozen = DEMO_TTL * 2.5
            procs.signal_group(sleeper.proc, signal.SIGSTOP)
            self.report.frozen_worker, self.report.frozen_s = sleeper.name, frozen
            self.say(f"chaos: SIGSTOP {sleeper.name} for {frozen:g}s (TTL {DEMO_TTL:g}s)")

            def thaw() -> None:
                procs.signal_group(sleeper.proc, signal.SIGCONT)
                self.say(f"chaos: SIGCONT {sleeper.name}")

            self.timer = threading.Timer(frozen, thaw)
            self.timer.daemon = True
            self.timer.start()
        if self.lock_server is not None and frac >= 0.5:
            server, self.lock_server = self.lock_server, None
            server.kill()  # a crash: every lock, fence and job record is gone
            self.report.lock_restarts += 1
            self.report.lock_restart_at = f"{int(frac * 100)}%"
            self.say(f"chaos: SIGKILL the lock redis-server; it comes back empty in "
                     f"{LOCK_OUTAGE:g}s (the broker, apart, keeps the queue)")

            def come_back() -> None:
                server.start()  # same port, no data
                self.say(f"chaos: lock redis-server back (pid {server.pid}), empty")

            self.lock_timer = threading.Timer(LOCK_OUTAGE, come_back)
            self.lock_timer.daemon = True
            self.lock_timer.start()

    def finish(self) -> None:
        for timer in (self.timer, self.lock_timer):
            if timer is not None:
                timer.join()


def run_demo(opts: DemoOptions, log: IO[str], err: IO[str]) -> Report:
    report = Report()
    started = time.monotonic()

    def say(text: str) -> None:
        err.write(f"demo: {text}\n" if not err.isatty() else f"\ndemo: {text}\n")
        err.flush()

    storm = plan_storm(opts)
    with servers(opts, say) as (urls, stack):
        lock_url = urls[f"{ENV_PREFIX}LOCK_URL"]
        journal = journal_url(urls)
        env = demo_env(opts, urls, journal)
        settings = settings_from(env)
        engine = make_engine(env[f"{ENV_PREFIX}DATABASE_URL"])
        seed_ledger(engine, storm)
        app = create_shop_app(settings, reconcile_at=None)
        app.loader.import_default_modules()  # register the included task modules here too
        keys = {job: app.tasks[job.task].identity(job.args, {})[0] for job in storm.jobs}
        fleet = Fleet(FleetOptions(workers=opts.workers, concurrency=opts.concurrency, beats=0,
                                   lock_url=lock_url, broker=env[f"{ENV_PREFIX}BROKER_URL"],
                                   database=env[f"{ENV_PREFIX}DATABASE_URL"], loglevel="INFO",
                                   shutdown_timeout=15.0, extra_env=env), out=log)
        try:
            fleet.start()
            fleet.wait_ready(60.0)
            say(f"fleet ready: {opts.workers} workers x {opts.concurrency}; publishing "
                f"{len(storm.publishes)} messages for {len(storm.jobs)} jobs")
            # Published from a thread, so the chaos strikes at its own points of progress
            # while the storm is still coming in.
            publisher = Publisher(app, storm)
            publisher.start()
            own_locks = stack.server if stack is not None and stack.lock_url == lock_url else None
            chaos = Chaos(fleet, say, report, own_locks) if opts.chaos else None
            progress = Progress(len(storm.jobs), err)
            deadline = started + opts.timeout
            done = 0
            while time.monotonic() < deadline:
                done = done_count(engine, list(keys.values()))
                progress.show(done)
                if chaos is not None:
                    chaos.on_progress(done / len(storm.jobs))
                if (done >= len(storm.jobs) and not publisher.is_alive()
                        and queue_idle(env[f"{ENV_PREFIX}BROKER_URL"])):
                    break
                time.sleep(0.25)
            progress.close()
            publisher.join()
            report.published = publisher.published
            if publisher.error:
                report.problems.append(f"publishing failed: {publisher.error}")
            if chaos is not None:
                chaos.finish()
            probe_conflicts(app, storm, opts, report, say)
        finally:
            fleet.stop()
        check_ledger(engine, storm, keys, report)
        count_events(journal_mod.read(journal), set(keys.values()), report)
        engine.dispose()
    report.elapsed_s = round(time.monotonic() - started, 2)
    return report


class Publisher(threading.Thread):
    """Publishes the storm's messages in order on one producer connection."""

    def __init__(self, app: Any, storm: Storm) -> None:
        super().__init__(name="demo-publisher", daemon=True)
        self.app = app
        self.storm = storm
        self.published = 0
        self.error = ""

    def run(self) -> None:
        try:
            with self.app.producer_or_acquire() as producer:
                for job, countdown in self.storm.publishes:
                    self.app.tasks[job.task].apply_async(
                        job.args, countdown=countdown, producer=producer
                    )
                    self.published += 1
        except Exception as exc:  # reported as a problem: the storm is incomplete
            self.error = f"{type(exc).__name__}: {exc}"


def probe_conflicts(app: Any, storm: Storm, opts: DemoOptions, report: Report,
                    say: Callable[[str], None]) -> None:
    """Re-send a few finished payments with another amount: each must be refused."""
    probes = [j for j in storm.jobs if j.task.endswith("charge")][:5]
    results = []
    for job in probes:
        payment_id, account, amount, currency = job.args
        results.append(app.tasks[job.task].apply_async((payment_id, account, amount + 1,
                                                        currency)))
    for res in results:
        try:
            res.get(timeout=30, propagate=True)
        except Exception as exc:
            if type(exc).__name__ == "IdempotencyConflict":
                report.conflicts_refused += 1
    report.conflicts_probed = len(probes)
    say(f"conflict probe: {report.conflicts_refused}/{len(probes)} re-sent payments with "
        "another amount refused")


# -- checking ------------------------------------------------------------------------------
def check_ledger(engine: Engine, storm: Storm, keys: dict[Job, str], report: Report) -> None:
    """Effects per job, balances and stock levels against the ledger; lost jobs."""
    report.distinct_jobs = len(storm.jobs)
    report.payments = sum(1 for j in storm.jobs if j.task.endswith("charge"))
    report.orders = report.distinct_jobs - report.payments
    with engine.connect() as conn:
        done = {r.job_key: json.loads(r.result) for r in conn.execute(
            select(jobs_table.c.job_key, jobs_table.c.result))}
        pay_rows = Counter(r.payment_id for r in conn.execute(select(payments.c.payment_id)))
        res_rows = Counter(r.order_id for r in conn.execute(select(reservations.c.order_id)))
        charged_sum = Counter[str]()
        for r in conn.execute(select(payments.c.account, payments.c.amount_cents)):
            charged_sum[r.account] += r.amount_cents
        balances = {r.account: r.balance_cents for r in conn.execute(select(accounts))}
        reserved_sum = Counter[str]()
        for r in conn.execute(select(reservations.c.sku, reservations.c.qty)):
            reserved_sum[r.sku] += r.qty
        levels = {r.sku: (r.received, r.quantity) for r in conn.execute(select(stock_table))}
    effects: list[int] = []
    for job in storm.jobs:
        result = done.get(keys[job])
        if result is None:
            report.lost_jobs += 1
            report.problems.append(f"lost job {job.business_id}: no DONE record")
            continue
        status = result.get("status")
        rows = pay_rows if job.task.endswith("charge") else res_rows
        n = rows.get(job.business_id, 0)
        if status == "charged":
            report.charged += 1
        elif status == "declined":
            report.declined += 1
        elif status == "reserved":
            report.reserved += 1
        elif status == "refused":
            report.refused += 1
        # A charged or reserved job has one ledger row; a declined or refused one has only
        # its DONE record, and must have no row.
        effect = n if status in ("charged", "reserved") else (1 if n == 0 else 1 + n)
        effects.append(effect)
        if effect != 1:
            report.double_effects += 1
            report.problems.append(f"job {job.business_id} took effect {effect} times")
    report.effects_per_job_min = min(effects, default=0)
    report.effects_per_job_max = max(effects, default=0)
    report.double_charges = sum(1 for n in pay_rows.values() if n > 1)
    for account, opening in storm.balances.items():
        if opening - charged_sum[account] != balances.get(account):
            report.double_charges += 1
            report.problems.append(f"account {account}: balance {balances.get(account)} != "
                                   f"opening {opening} - charged {charged_sum[account]}")
    for sku, (received, quantity) in levels.items():
        if quantity < 0 or received - reserved_sum[sku] != quantity:
            report.oversold += 1
            report.problems.append(f"sku {sku}: quantity {quantity}, received {received}, "
                                   f"reserved {reserved_sum[sku]}")
    if report.double_charges:
        report.problems.append(f"{report.double_charges} double charges")
    if report.conflicts_refused != report.conflicts_probed:
        report.problems.append(f"only {report.conflicts_refused}/{report.conflicts_probed} "
                               "conflicting payments refused")


def count_events(events: dict[str, Counter[str]], keys: set[str], report: Report) -> None:
    def total(event: str) -> int:
        return sum(n for k, n in events.get(event, Counter()).items() if k in keys)

    report.executions = total("started")
    report.duplicates_suppressed = total("conflict") + total("replayed")
    report.deferred_redeliveries = total("defer")
    report.retries = total("released")
    report.stale_writes_refused = total("stale")
    report.superseded = total("superseded") + report.stale_writes_refused
    report.leases_lost = total("lease_lost")
    report.redelivered = total("redeliver")


# -- output --------------------------------------------------------------------------------
def render(report: Report) -> str:
    r = report
    lines = [
        "",
        "jobfence demo report",
        "====================",
        f"  published messages        {r.published}",
        f"  distinct jobs             {r.distinct_jobs} ({r.payments} payments, {r.orders} orders)",
        f"  executions (bodies run)   {r.executions}",
        f"  duplicates suppressed     {r.duplicates_suppressed}",
        f"  redeliveries deferred     {r.deferred_redeliveries}",
        f"  retries                   {r.retries}",
        f"  stale writes refused      {r.stale_writes_refused}",
        f"  outcomes                  {r.charged} charged, {r.declined} declined, "
        f"{r.reserved} reserved, {r.refused} refused",
        f"  chaos                     SIGKILL {r.killed_worker or '-'}; SIGSTOP "
        f"{r.frozen_worker or '-'} for {r.frozen_s:g}s; lock server "
        + (f"down {LOCK_OUTAGE:g}s at {r.lock_restart_at}, back empty" if r.lock_restarts
           else "not restarted"),
        f"  leases lost, redelivered  {r.leases_lost}, {r.redelivered}   (by the freeze and "
        "the lock-server restart; jobs delivered again, never dropped)",
        f"  conflicting re-sends      {r.conflicts_refused}/{r.conflicts_probed} refused",
        "",
        f"  effects per job           min {r.effects_per_job_min}, max {r.effects_per_job_max}"
        "   (must be exactly 1)",
        f"  double charges            {r.double_charges}   (must be 0)",
        f"  oversold skus             {r.oversold}   (must be 0)",
        f"  lost jobs                 {r.lost_jobs}   (must be 0)",
        f"  elapsed                   {r.elapsed_s:.1f}s",
        "",
        "PASS: every job took effect exactly once" if r.passed else "FAIL:",
    ]
    lines += [f"  - {p}" for p in r.problems[:20]]
    return "\n".join(lines)


def as_json(report: Report) -> str:
    data = asdict(report)
    data["double_effects"] = report.double_effects + report.double_charges
    data["oversold"] = report.oversold
    data["passed"] = report.passed
    return json.dumps(data, sort_keys=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobfence demo", description=__doc__)
    p.add_argument("--workers", type=int, default=3, help="worker processes (>= 3 for chaos)")
    p.add_argument("--concurrency", type=int, default=2, help="pool processes per worker")
    p.add_argument("--jobs", type=int, default=300, help="distinct jobs")
    p.add_argument("--publishes", type=int, default=2000, help="messages published in all")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--fail-rate", type=float, default=0.1,
                   help="share of jobs whose first attempt fails and retries")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many s")
    p.add_argument("--no-chaos", action="store_true", help="do not kill or freeze workers")
    p.add_argument("--broker", help="broker URL (default: embedded redis-server)")
    p.add_argument("--lock-backend", help="lock URL, e.g. redis://host:6379/0")
    p.add_argument("--database", help="ledger SQLAlchemy URL (default: embedded SQLite)")
    p.add_argument("--env", action="store_true",
                   help="take the server URLs not given as options from JOBFENCE_BROKER_URL, "
                   "JOBFENCE_LOCK_URL and JOBFENCE_DATABASE_URL (passwords stay out of ps)")
    p.add_argument("--env-file", metavar="PATH",
                   help="as --env, reading those variables from this file (KEY=value lines)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--log", default=None, help="write the fleet's output to this file")
    return p


#: Where `--env` / `--env-file` find each server URL: (option's attribute, variable).
SERVER_VARIABLES = (
    ("broker", "JOBFENCE_BROKER_URL"),
    ("lock_backend", "JOBFENCE_LOCK_URL"),
    ("database", "JOBFENCE_DATABASE_URL"),
)


def server_urls(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> dict[str, str | None]:
    """broker, lock_backend and database: each option as given, else (with --env or
    --env-file) its JOBFENCE_* variable, so no password need be on the command line."""
    found: dict[str, str | None] = {name: getattr(args, name) for name, _ in SERVER_VARIABLES}
    source: Mapping[str, str | None] = {}
    if args.env_file:
        from dotenv import dotenv_values

        if not os.path.isfile(args.env_file):
            raise UnsafeSettings("--env-file", f"{args.env_file!r} is not a file",
                                 "give the path of a KEY=value file")  # fmt: skip
        source = dotenv_values(args.env_file)
    elif args.env:
        source = os.environ if environ is None else environ
    for name, variable in SERVER_VARIABLES:
        if not found[name] and source.get(variable):
            found[name] = source[variable]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        servers = server_urls(args)
    except UnsafeSettings as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    if args.workers < 1 or args.jobs < 2 or args.publishes < 1 or args.concurrency < 1:
        print("demo: --workers, --concurrency, --publishes must be >= 1 and --jobs >= 2",
              file=sys.stderr)
        return 2
    opts = DemoOptions(workers=args.workers, concurrency=args.concurrency, jobs=args.jobs,
                       publishes=args.publishes, seed=args.seed, broker=servers["broker"],
                       lock_backend=servers["lock_backend"], database=servers["database"],
                       fail_rate=args.fail_rate, timeout=args.timeout, chaos=not args.no_chaos)
    log_path = args.log
    try:
        if log_path:
            with open(log_path, "w", encoding="utf-8") as log:
                report = run_demo(opts, log, sys.stderr)
        else:
            import tempfile

            with tempfile.NamedTemporaryFile("w", prefix="jobfence-demo-", suffix=".log",
                                             delete=False, encoding="utf-8") as log:
                log_path = log.name
                report = run_demo(opts, log, sys.stderr)
    except UnsafeSettings as exc:
        print(f"demo: unsafe settings: {exc}", file=sys.stderr)
        return 2
    except RedisServerError as exc:  # no redis-server to start: one line with the fix
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    print(as_json(report) if args.json else render(report))
    if not args.json:
        print(f"  (fleet log: {log_path})")
    return 0 if report.passed else 1
