"""Violations of defects already filed (issue 18), tolerated by the suite's run until fixed.

The merger of a fix deletes its rows here and flips its seeds in ``seeds.json`` (``xfail``
off). ``MODEL_STRICT=1`` (and ``make fuzz``) tolerates nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from tests.model.scenario import Scenario, Violation

__all__ = ["KNOWN", "Known", "known_defect", "strict"]


@dataclass(frozen=True)
class Known:
    """``kind`` (and ``detail`` in its text, if given) under the options ``applies`` accepts."""

    defect: str
    kind: str
    applies: Callable[[Scenario], bool]
    detail: str = ""


#: Every violation the model found in issues 18 and 29 is fixed (its seeds in ``seeds.json``
#: now pass; the last, effect DONE rows keyed per key secret, by looking them up under the
#: previous secrets too). A row here tolerates a filed, unfixed defect in the suite's run, e.g.
#: ``Known("issue N defect M", "pending-forever", lambda s: s.options.dedupe_on_publish)``.
KNOWN: tuple[Known, ...] = ()


def strict() -> bool:
    return bool(os.environ.get("MODEL_STRICT") or os.environ.get("FUZZ_EXAMPLES"))


def known_defect(violation: Violation, scenario: Scenario) -> str | None:
    """The filed defect this violation is an instance of, if it is one (else None)."""
    for known in KNOWN:
        if (
            known.kind == violation.kind
            and known.detail in violation.detail
            and known.applies(scenario)
        ):
            return known.defect
    return None
