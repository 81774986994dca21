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


def _flushed(s: Scenario) -> bool:
    return any(step.kind == "flush" for step in s.steps)


KNOWN: tuple[Known, ...] = (
    Known("issue 18 defect 6", "marker-in-chain", lambda s: True),
    # A chain whose head is de-duplicated at publish is never published: defect 6 at publish
    # time (seeds "chain-head-deduped-at-publish*").
    Known("issue 18 defect 6", "chain-pending", lambda s: s.options.dedupe_on_publish),
    Known("issue 18 defect 6", "chain-stalled", lambda s: True),
    # A re-publish of a delivered message de-duplicated away: the slot requeue and the rate
    # turn (as filed), and Task.retry's re-publish once a flush lost the claim.
    Known("issue 18 defect 1", "pending-forever",
          lambda s: s.options.dedupe_on_publish
          and (bool(s.options.concurrency or s.options.global_rate_limit) or _flushed(s))),
    # Waiting behind a running copy spends max_retries or gives up at wait_timeout, under
    # lock_until="start" (as filed) and under "finish" (seeds "duplicate-*-behind-a-long-run").
    Known("issue 18 defect 11", "unexpected-failure",
          lambda s: s.options.on_conflict == "retry", "MaxRetriesExceededError"),
    Known("issue 18 defect 11", "unexpected-failure",
          lambda s: s.options.on_conflict == "wait", "AcquireTimeout"),
    Known("issue 18 defect 11", "lost-run", lambda s: s.options.lock_until == "start"),
    # Not filed yet: the publish claim's cleanup after a failed or refused run reaches the
    # paused lock server, and its error replaces the task's own (seed "claim-cleanup-*").
    Known("model: claim cleanup masks the error", "unexpected-failure",
          lambda s: any(step.kind == "blip" for step in s.steps), "swap_publish failed"),
    Known("model: claim cleanup masks the error", "unexpected-failure",
          lambda s: any(step.kind == "blip" for step in s.steps), "clear_publish failed"),
)  # fmt: skip


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
