"""Issue 18's model-based test: random sequences across option combinations, then invariants."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from tests.model.app import PLAIN
from tests.model.machine import ModelMachine, machine_settings
from tests.model.scenario import Harness, Scenario, Step


def test_random_sequences_keep_every_invariant(harness: Harness) -> None:
    """Every job took effect once or ended where its caller sees it; nothing twice, no slot
    overrun, nothing PENDING for ever, no marker passed along a chain."""

    class Machine(ModelMachine):
        pass

    Machine.harness = harness
    run_state_machine_as_test(Machine, settings=machine_settings())


def test_control_a_plain_task_redelivered_takes_effect_twice(harness: Harness) -> None:
    """The checks see a duplicate: a plain Celery task given the same message twice (the
    redelivery rule) writes its effect twice, where every jobfence option set writes once."""
    scenario = Scenario(harness, PLAIN)
    for step in (Step("publish", hold=0.4), Step("redeliver"), Step("redeliver")):
        scenario.run(step)
    scenario.drain()
    assert "effect-twice" in {v.kind for v in scenario.check()}
