"""Violations of defects already filed (issue 18), tolerated by the suite's run until fixed.

The merger of a fix deletes its row here and flips its seeds in ``seeds.json`` (``xfail``
off). ``MODEL_STRICT=1`` (and ``make fuzz``) tolerates nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from tests.model.app import Options
from tests.model.scenario import Violation

__all__ = ["KNOWN", "Known", "known_defect", "strict"]


@dataclass(frozen=True)
class Known:
    defect: str
    kind: str
    applies: Callable[[Options], bool]


KNOWN: tuple[Known, ...] = (
    Known("issue 18 defect 6", "marker-in-chain", lambda o: True),
    # A chain whose head is de-duplicated at publish is never published (defect 6's seam at
    # publish time; see the seed "chain-head-deduped-at-publish").
    Known("issue 18 defect 6", "chain-pending", lambda o: o.dedupe_on_publish),
    Known("issue 18 defect 6", "chain-stalled", lambda o: True),
    Known("issue 18 defect 1", "pending-forever",
          lambda o: o.lock_until == "start" and o.dedupe_on_publish
          and bool(o.concurrency or o.global_rate_limit)),
    Known("issue 18 defect 11", "unexpected-failure",
          lambda o: o.lock_until == "start" and o.on_conflict in ("wait", "retry")),
    Known("issue 18 defect 11", "lost-run", lambda o: o.lock_until == "start"),
)  # fmt: skip


def strict() -> bool:
    return bool(os.environ.get("MODEL_STRICT") or os.environ.get("FUZZ_EXAMPLES"))


def known_defect(violation: Violation, options: Options) -> str | None:
    """The filed defect this violation is an instance of, if it is one (else None)."""
    for known in KNOWN:
        if known.kind == violation.kind and known.applies(options):
            return known.defect
    return None
