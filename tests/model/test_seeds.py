"""The model's seed database: minimal failing sequences it found, replayed as plain tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.model.app import Options
from tests.model.scenario import Harness, Scenario, Step

SEEDS_PATH = Path(__file__).with_name("seeds.json")
#: A seed's jobs end within ~9 s when it holds; a seed that finds its violation PENDING
#: should not cost the machine's longer drain.
SEED_DRAIN = 12.0


def _seeds() -> list[Any]:
    params = []
    for seed in json.loads(SEEDS_PATH.read_text()):
        marks = []
        if seed.get("xfail"):
            marks.append(pytest.mark.xfail(strict=False, reason=seed["xfail"]))
        params.append(pytest.param(seed, seed["backend"], id=seed["name"], marks=marks))
    return params


@pytest.mark.parametrize(("seed", "harness"), _seeds(), indirect=["harness"], scope="module")
def test_seed_sequence_keeps_every_invariant(seed: dict[str, Any], harness: Harness) -> None:
    """Each seed names the violation it found (``found``); replayed, it must find none.
    A seed that cuts the database proves nothing unless its cut fired."""
    cuts = any(step["kind"] == "cut_db" for step in seed["steps"])
    if cuts and harness.cutter is None:
        pytest.skip("the effects database is not PostgreSQL here: no session to cut")
    scenario = Scenario(harness, Options(**seed["options"]))
    for step in seed["steps"]:
        scenario.run(Step(**step))
    scenario.drain(SEED_DRAIN)
    assert [str(v) for v in scenario.check()] == []
    if cuts:
        assert scenario.cuts_fired(), "the seed's database cut never fired"
