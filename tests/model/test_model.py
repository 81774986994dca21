"""Issue 18's model-based test: random sequences across option combinations, then invariants."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from tests.model.machine import ModelMachine, machine_settings
from tests.model.scenario import Harness


def test_random_sequences_keep_every_invariant(harness: Harness) -> None:
    """Every job took effect once or ended where its caller sees it; nothing twice, no slot
    overrun, nothing PENDING for ever, no marker passed along a chain."""

    class Machine(ModelMachine):
        pass

    Machine.harness = harness
    run_state_machine_as_test(Machine, settings=machine_settings())
