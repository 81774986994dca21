"""The hypothesis state machine: random publishes, redeliveries and faults on one option set."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from tests.model.app import MAX_COUNTDOWN, Options, valid_options
from tests.model.beat import BeatRules
from tests.model.known import known_defect, strict
from tests.model.scenario import CUT_AT, Harness, Scenario, Step

__all__ = [
    "ModelMachine",
    "PostgresModelMachine",
    "WorkerModelMachine",
    "machine_for",
    "machine_settings",
]

MODES = st.sampled_from(["ok", "ok", "retry", "fail"])
#: Short bodies; now and then one longer than the lease TTL (the keeper must carry it), or
#: than the conflict wait and slot wait (2 s).
HOLDS = st.sampled_from([0.02, 0.02, 0.02, 0.4, 1.6, 5.0])
COUNTDOWNS = st.one_of(st.none(), st.sampled_from([0.3, MAX_COUNTDOWN]))
PICKS = st.integers(min_value=0, max_value=7)
#: A chain also starts a new job now and then (its first publish is the chain's head).
CHAIN_PICKS = st.integers(min_value=-1, max_value=7)
#: A rotation's record reads: prompt, or late by about a short body's hold (a slow link:
#: a commit under one secret then lands between the other's record read and lock look).
READ_DELAYS = st.sampled_from([0.0, 0.4])


def machine_settings() -> settings:
    """Small and derandomized in the suite; ``FUZZ_EXAMPLES=N`` (``make fuzz``) runs N
    random sequences per backend and keeps failing ones in ``.hypothesis/model``."""
    fuzz = int(os.environ.get("FUZZ_EXAMPLES", "0") or 0)
    common: dict[str, Any] = {
        "deadline": None,
        "suppress_health_check": list(HealthCheck),
        "stateful_step_count": int(os.environ.get("FUZZ_STEPS", "10" if fuzz else "6")),
    }
    if fuzz:
        database = DirectoryBasedExampleDatabase(".hypothesis/model")
        return settings(max_examples=fuzz, database=database, **common)
    examples = int(os.environ.get("MODEL_EXAMPLES", "8"))
    return settings(max_examples=examples, derandomize=True, database=None, **common)


def fuzzed_options() -> list[Options]:
    """The combinations a run draws from: all, or (``FUZZ_OPTIONS=supersede``, a long run
    aimed at new ones) those whose task name holds that text."""
    wanted = os.environ.get("FUZZ_OPTIONS", "")
    chosen = [o for o in valid_options() if wanted in o.task_name]
    if not chosen:
        raise ValueError(f"FUZZ_OPTIONS={wanted!r} names no option combination's task")
    return chosen


class ModelMachine(RuleBasedStateMachine):
    """Drives one worker through one sequence; the invariants are checked at teardown."""

    harness: ClassVar[Harness]

    def __init__(self) -> None:
        super().__init__()
        self.scenario: Scenario | None = None

    @initialize(options=st.sampled_from(fuzzed_options()))
    def choose_options(self, options: Options) -> None:
        self.scenario = Scenario(self.harness, options)

    def _run(self, step: Step) -> None:
        assert self.scenario is not None
        self.scenario.run(step)

    @rule(mode=MODES, hold=HOLDS, countdown=COUNTDOWNS)
    def publish(self, mode: str, hold: float, countdown: float | None) -> None:
        self._run(Step("publish", mode=mode, hold=hold, countdown=countdown))

    @rule(at=st.sampled_from(["commit", "commit", "rollback", "died"]), mode=MODES,
          hold=HOLDS, countdown=COUNTDOWNS)  # fmt: skip
    def on_commit(self, at: str, mode: str, hold: float, countdown: float | None) -> None:
        self._run(Step("on_commit", mode=mode, hold=hold, countdown=countdown, at=at))

    @rule(job=PICKS, countdown=COUNTDOWNS)
    def duplicate(self, job: int, countdown: float | None) -> None:
        self._run(Step("duplicate", job=job, countdown=countdown))

    @rule(job=PICKS)
    def redeliver(self, job: int) -> None:
        self._run(Step("redeliver", job=job))

    @rule(job=CHAIN_PICKS, mode=MODES, hold=HOLDS)
    def chain(self, job: int, mode: str, hold: float) -> None:
        if job >= 0:
            mode, hold = "ok", 0.02  # not used: the picked job keeps its own
        self._run(Step("chain", job=job, mode=mode, hold=hold))

    @rule(seconds=st.sampled_from([0.1, 0.5]))
    def sleep(self, seconds: float) -> None:
        self._run(Step("sleep", seconds=seconds))

    @rule()
    def lose_leases(self) -> None:
        self._run(Step("lose_leases"))

    @precondition(lambda self: self.harness.locks is not None)
    @rule(seconds=st.sampled_from([0.2, 0.6]))
    def blip(self, seconds: float) -> None:
        self._run(Step("blip", seconds=seconds))

    @rule()
    def fork(self) -> None:
        self._run(Step("fork"))

    @precondition(lambda self: self.scenario is not None and not self.harness.model.rotating)
    @rule(seconds=READ_DELAYS)
    def rotate(self, seconds: float) -> None:
        self._run(Step("rotate", seconds=seconds))

    @precondition(lambda self: self.harness.locks is not None)
    @rule()
    def flush(self) -> None:
        self._run(Step("flush"))

    def teardown(self) -> None:
        scenario = self.scenario
        if scenario is None or not scenario.steps:
            return
        scenario.drain()
        tally = os.environ.get("FUZZ_TALLY")  # a long run's count of sequences checked
        if tally:
            with open(tally, "a") as out:
                out.write(f"{scenario.harness.backend} {len(scenario.steps)}\n")
        if scenario.cuts_fired():
            event(f"database sessions cut: {scenario.cuts_fired()}")
        violations = []
        for violation in scenario.check():
            defect = None if strict() else known_defect(violation, scenario)
            if defect is None:
                violations.append(violation)
            else:
                event(f"tolerated ({defect}): {violation.kind}")
        assert not violations, "\n".join(map(str, violations)) + "\nseed: " + scenario.describe()


class PostgresModelMachine(ModelMachine):
    """The machine where the effects live on PostgreSQL: one step more, a database session
    killed at a chosen statement of the next effect transaction. A class of its own, so the
    other harness's rule list, and with it its derandomized sequences, stays as it was
    (hypothesis draws a rule by its place in the list)."""

    @precondition(lambda self: self.harness.cutter is not None)
    @rule(at=st.sampled_from(sorted(CUT_AT)))
    def cut_db(self, at: str) -> None:
        event(f"cut_db armed at: {at}")
        self._run(Step("cut_db", at=at))


#: A pause past the lease and custody TTL (1.5 s): the put-back comes within ~2.5 s of it.
PAUSES = st.sampled_from([3.0, 4.0])


class WorkerModelMachine(PostgresModelMachine):
    """The redis harness's machine: two steps more on its second worker process, a pause
    past the TTL (custody's put-back, the stale ack) and a kill (the put-back delivered to
    the restarted worker). A class of its own, as PostgresModelMachine is, so the memory
    harness's rule list stays as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.second_used = False

    @precondition(lambda self: self.harness.second is not None and not self.harness.model.rotating)
    @rule(seconds=PAUSES, hold=HOLDS)
    def pause_worker(self, seconds: float, hold: float) -> None:
        self.second_used = True
        event(f"pause_worker: {seconds:g}s")
        self._run(Step("pause_worker", seconds=seconds, hold=hold))

    @precondition(lambda self: self.harness.second is not None and not self.harness.model.rotating)
    @rule(hold=HOLDS)
    def kill_worker(self, hold: float) -> None:
        self.second_used = True
        event("kill_worker")
        self._run(Step("kill_worker", hold=hold))

    # The second worker keeps one secret: a rotation's side-by-side phase is this process's
    # own (ModelApp.reconfigure), so no rotation once a job has gone to the second worker.
    @precondition(
        lambda self: (
            self.scenario is not None and not self.harness.model.rotating and not self.second_used
        )
    )
    @rule(seconds=READ_DELAYS)
    def rotate(self, seconds: float) -> None:
        self._run(Step("rotate", seconds=seconds))


def machine_for(harness: Harness) -> type[ModelMachine]:
    """The machine whose steps `harness` can run (the worker processes' and the beat's on
    the redis harness only)."""
    base: type[ModelMachine] = PostgresModelMachine if harness.cutter is not None else ModelMachine
    if harness.second is not None:
        base = WorkerModelMachine
    if harness.backend != "redis":
        return base
    return type(f"Beat{base.__name__}", (BeatRules, base), {})
