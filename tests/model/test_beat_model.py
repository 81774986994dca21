"""Issue 29: the model's beat steps (tests/model/beat.py) under every lifetime, with controls."""

from __future__ import annotations

import uuid

import pytest

from tests.model.app import Options
from tests.model.scenario import Harness, Scenario, Step

#: One option set per lifetime: a run per key, per publish (start), per window (unique_for),
#: and deduplicated at publish.
LIFETIMES = {
    "finish": Options("skip", "finish", None, False, "result", 0, None),
    "start": Options("wait", "start", None, False, "result", 0, None),
    "unique_for": Options("retry", "finish", 1.0, False, "result", 0, None),
    "dedupe-replace": Options("raise", "start", None, True, "replace", 0, None),
}
#: A kill between a slot's publish and its mark, a restart, a hand-over, a plain restart.
SEQUENCE = [
    Step("beat_tick"),
    Step("beat_restart", seconds=1.5, at="unmarked"),
    Step("beat_handover", seconds=2.0, at="unmarked"),
    Step("beat_tick", hold=0.4),
    Step("beat_restart", seconds=3.0),
]


def _run(harness: Harness, options: Options, steps: list[Step]) -> list[str]:
    scenario = Scenario(harness, options)
    for step in steps:
        scenario.run(step)
    scenario.drain()
    return [str(v) for v in scenario.check()]


@pytest.mark.parametrize("harness", ["redis"], indirect=True)
@pytest.mark.parametrize("lifetime", sorted(LIFETIMES))
def test_beat_kills_restarts_and_hand_overs_keep_every_invariant(
    harness: Harness, lifetime: str
) -> None:
    """Every slot sent (within the catch-up window) takes effect once, whichever beat sent
    it and however often: a slot re-sent after a kill between its publish and its mark
    carries the same task id."""
    assert _run(harness, LIFETIMES[lifetime], SEQUENCE) == []


@pytest.mark.parametrize("harness", ["redis"], indirect=True)
def test_control_with_the_catch_up_off_a_restart_loses_slots(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tests.model.beat.CATCHUP", 0.0)
    found = _run(harness, LIFETIMES["finish"], [Step("beat_restart", seconds=3.0)])
    assert any(v.startswith("beat-slot-lost") for v in found), found


@pytest.mark.parametrize("harness", ["redis"], indirect=True)
def test_control_random_slot_task_ids_run_a_re_sent_slot_twice(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the beat sent before issue 29 #5: a task id of its own per copy."""
    monkeypatch.setattr("jobfence.worker.beat.slot_task_id", lambda *_: str(uuid.uuid4()))
    steps = [Step("beat_tick"), Step("beat_restart", seconds=1.0, at="unmarked")]
    found = _run(harness, LIFETIMES["start"], steps)
    assert any(v.startswith("beat-slot-twice") for v in found), found
