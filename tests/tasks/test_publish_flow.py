"""The publish claim's flows fed scripted replies, with no server: every branch of a publish."""

from __future__ import annotations

from typing import Any

import pytest

from jobfence.locks import BackendUnavailable, ManualClock, MemoryBackend
from jobfence.locks.drive import run_sync
from jobfence.locks.flows import Flow
from jobfence.locks.ops import ClaimPublish, ClearPublish, Op, SwapPublish
from jobfence.tasks.errors import DuplicatePublish
from jobfence.tasks.publish import (
    REPLACE_ATTEMPTS,
    DuplicatePublishPolicy,
    PublishDecision,
    give_back_flow,
    ordered_id,
    publish_flow,
    published_at,
)

KEY, ME, TTL = "job-key", "task-me", 60.0


def script(flow: Flow[Any], replies: list[Any]) -> tuple[list[Op], Any]:
    """Run `flow` by hand: each op answered by the next reply (an exception is thrown in);
    the ops it yielded and its value. Every reply must be used."""
    ops: list[Op] = []
    pending = list(replies)
    reply: Any = None
    try:
        op = flow.send(None)
        while True:
            ops.append(op)
            reply = pending.pop(0)
            op = flow.throw(reply) if isinstance(reply, BaseException) else flow.send(reply)
    except StopIteration as stop:
        assert not pending, f"replies left unused: {pending}"
        return ops, stop.value


def decide(
    replies: list[Any], policy: DuplicatePublishPolicy = "result", *, workflow: bool = False
) -> tuple[list[Op], PublishDecision]:
    flow = publish_flow(KEY, ME, TTL, policy=policy, workflow=workflow, name="t.job")
    return script(flow, replies)


@pytest.mark.parametrize("policy", ["result", "raise", "replace"])
def test_a_free_key_is_claimed_in_one_round_trip(policy: DuplicatePublishPolicy) -> None:
    ops, decision = decide([None], policy)
    assert ops == [ClaimPublish(KEY, ME, TTL)]
    assert decision == PublishDecision("claimed")


@pytest.mark.parametrize("held", [ME, "!" + ME])
def test_our_own_claim_is_ours_to_publish_under(held: str) -> None:
    # A retry or deferred copy of our own job, queued or started: never its own duplicate.
    ops, decision = decide([held], "raise")
    assert ops == [ClaimPublish(KEY, ME, TTL)]
    assert decision == PublishDecision("claimed")


@pytest.mark.parametrize("held", ["other", "!other"])
def test_a_duplicate_gets_the_holders_result(held: str) -> None:
    ops, decision = decide([held], "result")
    assert ops == [ClaimPublish(KEY, ME, TTL)]
    assert decision == PublishDecision("result", holder="other")


@pytest.mark.parametrize(("held", "state"), [("other", "queued"), ("!other", "running")])
def test_a_duplicate_raises_naming_the_holder(held: str, state: str) -> None:
    flow = publish_flow(KEY, ME, TTL, policy="raise", workflow=False, name="t.job")
    assert flow.send(None) == ClaimPublish(KEY, ME, TTL)
    with pytest.raises(DuplicatePublish) as caught:
        flow.send(held)
    assert caught.value.task_id == "other" and caught.value.key == KEY
    assert state in str(caught.value) and "on_duplicate_publish='raise'" in str(caught.value)


def test_replace_takes_the_claim_from_the_queued_copy() -> None:
    ops, decision = decide(["other", None], "replace")
    assert ops == [ClaimPublish(KEY, ME, TTL), SwapPublish(KEY, "other", ME, TTL)]
    assert decision == PublishDecision("claimed", previous="other")


def test_replace_never_replaces_a_started_copy() -> None:
    ops, decision = decide(["!other"], "replace")
    assert ops == [ClaimPublish(KEY, ME, TTL)]  # no swap: two would run
    assert decision == PublishDecision("result", holder="other")


def test_replace_raced_by_the_holder_starting_answers_with_its_result() -> None:
    ops, decision = decide(["other", "!other", "!other"], "replace")
    assert ops == [
        ClaimPublish(KEY, ME, TTL),
        SwapPublish(KEY, "other", ME, TTL),
        ClaimPublish(KEY, ME, TTL),  # the claim moved: look again
    ]
    assert decision == PublishDecision("result", holder="other")


def test_replace_raced_every_time_gives_up_after_its_attempts() -> None:
    replies: list[Any] = []
    for n in range(REPLACE_ATTEMPTS):
        replies += [f"copy{n}", f"copy{n + 1}"]  # each swap finds a newer copy there
    ops, decision = decide(replies, "replace")
    assert len(ops) == 2 * REPLACE_ATTEMPTS
    assert decision == PublishDecision("result", holder=f"copy{REPLACE_ATTEMPTS - 1}")


@pytest.mark.parametrize("policy", ["result", "replace"])
def test_a_workflows_duplicate_goes_out_unclaimed(policy: DuplicatePublishPolicy) -> None:
    # The workflow waits on this task id: an AsyncResult of the holder would never answer it.
    _, decision = decide(["!other"], policy, workflow=True)
    assert decision == PublishDecision("unclaimed", holder="other")


def test_a_workflows_duplicate_still_raises_under_raise() -> None:
    with pytest.raises(DuplicatePublish):
        decide(["other"], "raise", workflow=True)


def test_an_unanswered_claim_fails_the_publish() -> None:
    flow = publish_flow(KEY, ME, TTL, policy="result", workflow=False, name="t.job")
    flow.send(None)
    with pytest.raises(BackendUnavailable):
        flow.throw(BackendUnavailable("no reply", key=KEY))


def test_a_failed_first_publish_clears_the_claim() -> None:
    ops, ok = script(give_back_flow(KEY, ME, TTL, previous=None), [None])
    assert ops == [ClearPublish(KEY)] and ok is True


def test_a_failed_replace_gives_the_claim_back_to_the_queued_copy() -> None:
    ops, ok = script(give_back_flow(KEY, ME, TTL, previous="other"), [None])
    assert ops == [SwapPublish(KEY, ME, "other", TTL)] and ok is True


def test_a_claim_moved_meanwhile_is_not_given_back() -> None:
    _, ok = script(give_back_flow(KEY, ME, TTL, previous="other"), ["newer"])
    assert ok is False


def test_the_flows_run_on_a_store() -> None:
    # The ops' adapter (LockBackend.execute): the same decisions against the memory store.
    store, clock = MemoryBackend(), ManualClock()
    claim = publish_flow(KEY, "A", TTL, policy="replace", workflow=False, name="t.job")
    assert run_sync(claim, store, clock) == PublishDecision("claimed")
    replace = publish_flow(KEY, "B", TTL, policy="replace", workflow=False, name="t.job")
    assert run_sync(replace, store, clock) == PublishDecision("claimed", previous="A")
    assert run_sync(give_back_flow(KEY, "B", TTL, previous="A"), store, clock) is True
    assert store.claim_publish(KEY, "C", TTL) == "A"  # A holds it again
    assert run_sync(give_back_flow(KEY, "C", TTL, previous=None), store, clock) is True
    assert store.claim_publish(KEY, "D", TTL) is None  # cleared: the next publish goes out


# ------------------------------------------------ an outbox row sent late, ordered by task ids


def test_an_ordered_id_is_a_uuid7_that_tells_when_it_was_made() -> None:
    import time
    import uuid

    before = time.time()
    made = ordered_id()
    after = time.time()
    parsed = uuid.UUID(made)
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    at = published_at(made)
    assert at is not None and before - 0.001 <= at <= after
    assert ordered_id() != made
    for other in (str(uuid.uuid4()), "a-callers-own-id", ""):
        assert published_at(other) is None


@pytest.mark.parametrize("started", [False, True])
def test_a_late_row_does_not_replace_a_newer_publishs_claim(started: bool) -> None:
    newer = ordered_id()
    written = (published_at(newer) or 0.0) - 5.0  # the row: written five seconds earlier
    held = ("!" if started else "") + newer
    flow = publish_flow(KEY, ME, TTL, policy="replace", workflow=True, name="t.job",
                        replace_started=True, written_at=written)  # fmt: skip
    ops, decision = script(flow, [held])
    assert ops == [ClaimPublish(KEY, ME, TTL)], "it swapped the newer publish's claim"
    assert decision == PublishDecision("unclaimed", holder=newer)


@pytest.mark.parametrize("holder", ["older", "unknown"])
def test_a_late_row_replaces_an_older_or_unordered_claim(holder: str) -> None:
    older = ordered_id()
    written = (published_at(older) or 0.0) + 5.0
    held = older if holder == "older" else "a-callers-own-id"
    flow = publish_flow(KEY, ME, TTL, policy="replace", workflow=True, name="t.job",
                        replace_started=True, written_at=written)  # fmt: skip
    ops, decision = script(flow, [held, None])
    assert ops[1] == SwapPublish(KEY, held, ME, TTL)
    assert decision == PublishDecision("claimed", previous=held)
