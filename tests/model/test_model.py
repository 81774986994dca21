"""Issue 18's model-based test: random sequences across option combinations, then invariants."""

from __future__ import annotations

import uuid

import pytest
from celery.result import AsyncResult
from hypothesis.stateful import run_state_machine_as_test

from jobfence.worker.custody import Custody
from tests.model.app import PLAIN, valid_options
from tests.model.machine import machine_for, machine_settings
from tests.model.scenario import Harness, Publish, Scenario, Step
from tests.servers import wait_for


def test_random_sequences_keep_every_invariant(harness: Harness) -> None:
    """Every job took effect once or ended where its caller sees it; nothing twice, no slot
    overrun, nothing PENDING for ever, no marker passed along a chain."""

    machine = type("Machine", (machine_for(harness),), {"harness": harness})
    run_state_machine_as_test(machine, settings=machine_settings())


def test_control_a_plain_task_redelivered_takes_effect_twice(harness: Harness) -> None:
    """The checks see a duplicate: a plain Celery task given the same message twice (the
    redelivery rule) writes its effect twice, where every jobfence option set writes once."""
    scenario = Scenario(harness, PLAIN)
    for step in (Step("publish", hold=0.4), Step("redeliver"), Step("redeliver")):
        scenario.run(step)
    scenario.drain()
    assert "effect-twice" in {v.kind for v in scenario.check()}


#: A job paused (3 s) in its hold (4 s): custody puts it back within ~2.5 s (its custody
#: record lapses one TTL after the last, 0.5 s apart, then the next sweep) and the other worker
#: process runs the copy to >= 5.5 s; the paused one stops at 4 s (its lease lost), acks, takes
#: the next job, and both processes are killed while the copy still runs.
PAUSE_THEN_CRASH = (
    Step("pause_worker", seconds=3.0, hold=4.0),
    Step("kill_worker", hold=0.4),
)


#: The control's second shape: a longer pause (5 s in a 6 s hold) leaves a late custody sweep on
#: a loaded machine 2.5 s more to put the job back while its holder is stopped, which the loss
#: needs; the control tries both shapes in turn (each missed the loss now and then alone).
PAUSE_LONGER_THEN_CRASH = (
    Step("pause_worker", seconds=5.0, hold=6.0),
    Step("kill_worker", hold=0.4),
)


def _pause_then_crash(harness: Harness, steps: tuple[Step, ...] = PAUSE_THEN_CRASH) -> Scenario:
    if harness.second is None:
        pytest.skip("the second worker process runs on the redis harness only")
    scenario = Scenario(harness, valid_options()[0])
    for step in steps:
        scenario.run(step)
    scenario.drain()
    return scenario


def test_a_paused_workers_jobs_come_back_once_after_the_new_holder_crashes(
    harness: Harness,
) -> None:
    """Issue 29, "the model learns lifetimes": the second worker paused past its TTL (custody
    puts its job back under a fresh tag, its own late ack is stale), then killed while it runs
    the put-back copy: every job takes effect once, nothing PENDING, the log true."""
    scenario = _pause_then_crash(harness)
    assert [str(v) for v in scenario.check()] == []
    assert len(scenario.harness.model.effects(scenario.prefix)) == 2
    assert harness.second is not None
    paused = scenario.publishes[0].task_id
    began = [e.worker for e in harness.second.fleet.events(paused) if e.kind == "prerun"]
    assert set(began[:2]) == {0, 1}, began  # the put-back copy ran on the other process
    # The processes report what their decision writers stored (a kill's exemptions are read
    # from it: second.restart); without a report every kill would exempt every delivery.
    fleet = harness.second.fleet
    wait_for(lambda: any(e.kind == "stored" for e in fleet.events()), timeout=30.0,
             message="no worker process reported a stored batch of decisions")  # fmt: skip


def test_control_a_put_back_under_the_old_tag_loses_the_paused_job(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same steps with every custody putting back under the old tag (kombu's
    restore_by_tag, as before defect 1's fix): the paused holder's late ack removes the new
    holder's entry, its kill leaves nothing to put back, the job is lost."""
    if harness.second is None:
        pytest.skip("the worker processes run on the redis harness only")
    monkeypatch.setattr(Custody, "put_back", naive_put_back)  # this process sweeps too
    harness.second.restart({"NAIVE_PUT_BACK": "1"})
    seen: list[set[str]] = []
    try:
        # The loss needs the put-back to land while the holder is stopped; on a loaded
        # machine a sweep may come late. The defect must show in one of four tries.
        for steps in (PAUSE_THEN_CRASH, PAUSE_LONGER_THEN_CRASH) * 2:
            scenario = _pause_then_crash(harness, steps)
            seen.append({v.kind for v in scenario.check()})
            if {"lost-job", "pending-forever"} & seen[-1]:
                break
    finally:
        harness.second.restart({"NAIVE_PUT_BACK": ""})
    assert {"lost-job", "pending-forever"} & seen[-1], seen


def naive_put_back(self: Custody, tag: str) -> bool:
    self.qos.restore_by_tag(tag, client=self.channel.client)
    return True


#: Issue 34: a job published on commit, one whose transaction rolled back, one whose process
#: died between its commit and its publish (the relay sends it), then a duplicate and a
#: redelivery of the committed ones.
ON_COMMIT = (
    Step("on_commit", at="commit", hold=0.2),
    Step("on_commit", at="rollback"),
    Step("on_commit", at="died", countdown=0.3),
    Step("duplicate", job=0),
    Step("redeliver", job=1),
)


def test_publish_on_commit_steps_keep_every_invariant(harness: Harness) -> None:
    options = next(o for o in valid_options() if o.dedupe_on_publish and o.concurrency == 0
                   and o.on_conflict == "skip" and o.global_rate_limit is None)  # fmt: skip
    scenario = Scenario(harness, options)
    for step in ON_COMMIT:
        scenario.run(step)
    scenario.drain()
    assert [str(v) for v in scenario.check()] == []
    ran = {e["job_id"] for e in harness.model.effects(scenario.prefix)}
    assert ran == {scenario.jobs[0].job_id, scenario.jobs[1].job_id}


def test_control_a_commit_no_one_publishes_is_caught(harness: Harness) -> None:
    """The checks see a committed job that was never sent: the relay held back (its grace
    past the drain), the "died" step's job stays PENDING and its row unsent."""
    assert harness.relay is not None
    grace, harness.relay.grace = harness.relay.grace, 3600.0
    try:
        scenario = Scenario(harness, valid_options()[0])
        scenario.run(Step("on_commit", at="died"))
        scenario.drain(timeout=2.0)
        kinds = {v.kind for v in scenario.check()}
    finally:
        harness.relay.grace = grace
    assert {"outbox-unsent", "pending-forever"} <= kinds, kinds
    scenario.drain()  # the relay sends it now: nothing left for later sequences


def test_a_debounced_burst_with_a_redelivery_runs_once(harness: Harness) -> None:
    """Issue 34: a publish, three duplicates within the quiet period and a redelivery of the
    first: one run (the last publish's), every other copy a typed stop, the log true."""
    options = next(o for o in valid_options() if o.debounce is not None
                   and o.debounce_max_wait is None and o.concurrency == 0
                   and o.global_rate_limit is None and o.on_conflict == "wait")  # fmt: skip
    scenario = Scenario(harness, options)
    steps = [Step("publish", hold=0.2), Step("duplicate"), Step("duplicate"),
             Step("duplicate"), Step("redeliver")]  # fmt: skip
    for step in steps:
        scenario.run(step)
    scenario.drain()
    assert [str(v) for v in scenario.check()] == []
    effects = harness.model.effects(scenario.prefix)
    ids = [p.task_id for p in scenario.publishes]
    states = [AsyncResult(i, app=harness.model.app).state for i in ids]
    # The last publish runs; every other copy stopped (typed) unless a publish came later
    # than the quiet period after it (a loaded machine), which then ran as a burst of its own.
    ran = {e["task_id"] for e in effects}
    assert states[3] == "SUCCESS", states
    assert ran == {i for i, state in zip(ids, states, strict=True) if state == "SUCCESS"}
    assert len(effects) == len(ran)


def test_a_superseding_publish_with_a_redelivery_of_the_first(harness: Harness) -> None:
    """Issue 34: a long run, a duplicate that supersedes it, and a redelivery of the first
    copy: the newest publish runs, the first never outlives it (superseded, or finished
    before), the redelivered older copy never runs after the newest, the log true."""
    options = next(o for o in valid_options() if o.on_conflict == "supersede"
                   and o.concurrency == 0 and o.global_rate_limit is None)  # fmt: skip
    scenario = Scenario(harness, options)
    for step in (Step("publish", hold=1.0), Step("sleep", seconds=0.3), Step("duplicate"),
                 Step("redeliver")):  # fmt: skip
        scenario.run(step)
    scenario.drain()
    assert [str(v) for v in scenario.check()] == []
    ids = [p.task_id for p in scenario.publishes]
    assert AsyncResult(ids[-1], app=harness.model.app).state == "SUCCESS"
    ran = [e["task_id"] for e in harness.model.effects(scenario.prefix)]
    assert ran[-1] == ids[-1], ran  # the newest publish's effect is the last to land


def test_an_outbox_row_sent_late_never_supersedes_a_newer_publish(harness: Harness) -> None:
    """Issue 34: a row whose process died before its publish, then a newer publish of the
    same job; the relay sends the row after its grace. The newer publish runs and the row's
    copy gives way (the newest check now counts outbox rows from when they were written;
    before task ids told their time, the row's copy took the newer one's claim)."""
    options = next(o for o in valid_options() if o.on_conflict == "supersede"
                   and o.concurrency == 0 and o.global_rate_limit is None)  # fmt: skip
    scenario = Scenario(harness, options)
    for step in (Step("on_commit", at="died", hold=0.3), Step("duplicate", job=0)):
        scenario.run(step)
    scenario.drain()
    assert [str(v) for v in scenario.check()] == []
    _row, newer = scenario.publishes
    assert AsyncResult(newer.task_id, app=harness.model.app).state == "SUCCESS"
    ran = [e["task_id"] for e in harness.model.effects(scenario.prefix)]
    assert ran == [newer.task_id], ran


def test_control_the_newest_check_sees_an_older_copy_win(harness: Harness) -> None:
    """The check that the newest publish is never superseded can fail: the same sequence's
    record with the outcomes of the two publishes swapped is caught."""
    options = next(o for o in valid_options() if o.on_conflict == "supersede"
                   and o.concurrency == 0 and o.global_rate_limit is None)  # fmt: skip
    scenario = Scenario(harness, options)
    for step in (Step("publish", hold=1.0), Step("sleep", seconds=0.3), Step("duplicate")):
        scenario.run(step)
    scenario.drain()
    first, newest = scenario.publishes
    first.task_id, newest.task_id = newest.task_id, first.task_id  # as if the older won
    assert "newest-superseded" in {v.kind for v in scenario.check()}


def test_a_retry_state_stored_after_the_retried_copy_ended_is_no_pending_job(
    harness: Harness,
) -> None:
    """Celery publishes a retry before it stores RETRY; under load the retried copy ends
    first and RETRY overwrites its state (the fuzz run of 2026-11-29). The decision log
    shows the retried copy ended: not pending. Control: a RETRY no delivery ever ended is."""
    options = next(o for o in valid_options() if o.on_conflict == "skip"
                   and o.concurrency == 0 and o.global_rate_limit is None)  # fmt: skip
    scenario = Scenario(harness, options)
    scenario.run(Step("publish", mode="retry"))
    scenario.drain()
    assert [str(v) for v in scenario.check()] == []
    (publish,) = scenario.publishes
    backend = harness.model.app.backend
    # As the race does: the retried copy's state overwritten by the first try's RETRY
    # (Celery keeps a SUCCESS from being overwritten, not a FAILURE such as a typed stop).
    backend.forget(publish.task_id)
    backend.mark_as_retry(publish.task_id, RuntimeError("stored late"))
    assert AsyncResult(publish.task_id, app=harness.model.app).state == "RETRY"
    assert [str(v) for v in scenario.check()] == []
    never = Publish(publish.job, "publish", task_id=str(uuid.uuid4()))
    backend.mark_as_retry(never.task_id, RuntimeError("never ended"))
    scenario.publishes.append(never)
    assert {v.kind for v in scenario.check()} == {"pending-forever"}
