"""The job lifecycle's flows fed scripted replies, with no server: every branch of a delivery.

Each test is a list of (expected op, reply) pairs: the op the flow must yield next (a type,
or an op to compare equal) and what the store (or the shell) answers; an exception as the
reply is thrown into the flow, a function is called with the script and the op. `Event`,
`Now` and `Sleep` are answered by the script itself (the job's log and metrics middleware
told, a scripted clock read and moved), so a test lists only what decides.
"""

from __future__ import annotations

import json
import random
from collections.abc import Generator
from typing import Any

import pytest

from jobfence.locks import BackendUnavailable, ManualClock, MemoryBackend
from jobfence.locks.backend import Busy, JobRecord, LockInfo, RateGrant
from jobfence.locks.errors import AcquireTimeout, CommitOutcomeUnknown, LeaseLost, StaleFence
from jobfence.locks.flows import Backoff
from jobfence.locks.lease import Lease
from jobfence.locks.ops import (
    Begin,
    Commit,
    CountDelivery,
    Inspect,
    LeaveSlot,
    Now,
    ReadRecord,
    Release,
    Sleep,
    SwapPublish,
    TakeRate,
    TakeSlot,
    WaitRelease,
)
from jobfence.locks.slots import SlotLease, SlotWait
from jobfence.tasks.errors import DuplicateJob, IdempotencyConflict, PoisonMessage
from jobfence.tasks.events import TABLE, Event
from jobfence.tasks.lifecycle import (
    COMMIT_ATTEMPTS,
    DUPLICATE,
    RATE_HORIZON,
    ROTATION_GRACE,
    START_SUFFIX,
    AfterOuterCommit,
    Drop,
    Job,
    JobSpec,
    Keep,
    Outcome,
    RateSpec,
    Redelivery,
    RedeliveryLimitReached,
    RunBody,
    job_flow,
)
from jobfence.tasks.metrics import Metrics
from jobfence.tasks.middleware import Counting, LogLines, Middleware
from tests.tasks import conftest

KEY, FP, ME, TTL = "job-key", "fp-1", "task-me", 30.0
CLOCK = ManualClock(1000.0)  # the leases' clock; the flows read time only through Now
NEVER_ASKED = MemoryBackend(clock=CLOCK)  # leases are made here, never granted or released


class Script:
    """Runs a job flow by hand: each op it yields must match the next step, which answers
    it. Event, Now and Sleep are answered here: each event goes to `middleware` (as the
    shell's would) and its decision is kept in `notes`, time is `now` (Sleep moves it)."""

    def __init__(
        self,
        flow: Generator[Any, Any, Any],
        *,
        now: float = 1000.0,
        spec: JobSpec | None = None,
        middleware: tuple[Middleware, ...] = (),
    ) -> None:
        self.flow = flow
        self.spec = spec or spec_for()  # what the middleware see of the delivery
        self.middleware = middleware
        self.now = now
        self.ops: list[Any] = []
        self.notes: list[str] = []
        self.left: list[tuple[Any, Any]] = []

    def run(self, *steps: tuple[Any, Any]) -> Any:
        """The flow's value once every step is used; what it raises goes on (steps used)."""
        self.left = list(steps)
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = self.flow.send(reply) if error is None else self.flow.throw(error)
            except StopIteration as stop:
                assert not self.left, f"the flow ended with steps left: {self.left}"
                return stop.value
            except BaseException:
                assert not self.left, f"the flow raised with steps left: {self.left}"
                raise
            reply = error = None
            self.ops.append(op)
            if isinstance(op, Event):
                row = TABLE[op.kind]
                if row.decision is not None:
                    self.notes.append(row.decision)
                for m in self.middleware:
                    if m.wants(row):
                        m.on_event(self, op, row)
                continue
            if isinstance(op, Now):
                reply = self.now
                continue
            if isinstance(op, Sleep):
                self.now += op.seconds
                continue
            assert self.left, f"the flow yielded {op!r} after the last step"
            expected, answer = self.left.pop(0)
            if isinstance(expected, type):
                assert isinstance(op, expected), f"expected {expected.__name__}, got {op!r}"
            else:
                assert op == expected, f"expected {expected!r}, got {op!r}"
            if isinstance(answer, BaseException):
                error = answer
            elif callable(answer):  # a reply with a side effect (time passing, a body's work)
                reply = answer(self, op)
            else:
                reply = answer

    def of(self, kind: type) -> list[Any]:
        """The ops of `kind` the flow yielded, in order."""
        return [op for op in self.ops if isinstance(op, kind)]


def spec_for(**overrides: Any) -> JobSpec:
    fields: dict[str, Any] = {"fingerprint": FP, "task_id": ME, "ttl": TTL}
    fields.update(overrides)
    return conftest.spec_for(KEY, **fields)


class Observed(Job):
    """A job with the metrics its script's middleware count into (the flow counts nothing)."""

    metrics: Metrics


def job(metrics: Metrics | None = None, limit: int = 20, **overrides: Any) -> Observed:
    j = Observed(
        spec_for(**overrides),
        backoff=Backoff(0.01, 0.1, rng=random.Random(7)),
        redelivery=Redelivery(limit=limit, rng=random.Random(7)),
    )
    j.metrics = metrics or Metrics()
    return j


def run_flow(j: Observed, passthrough: tuple[type[BaseException], ...] = ()) -> Script:
    """`j`'s flow under a script, its events told to the log lines and metrics middleware."""
    return Script(j.run(passthrough), spec=j.spec, middleware=(LogLines(), Counting(j.metrics)))


def lease(fence: int = 7, key: str = KEY, left: float = TTL) -> Lease:
    return Lease(key=key, owner="owner-" + key, fence=fence, ttl=TTL,
                 deadline=1000.0 + left, backend=NEVER_ASKED, clock=CLOCK)  # fmt: skip


def slot_lease(fence: int = 3) -> SlotLease:
    return SlotLease(key="group", owner="slot-owner", fence=fence, ttl=TTL,
                     deadline=1000.0 + TTL, backend=NEVER_ASKED, clock=CLOCK, limit=1)  # fmt: skip


def record(result: Any = "ok", fence: int = 5, fingerprint: str = FP) -> JobRecord:
    return JobRecord("DONE", fingerprint, json.dumps(result), fence, 0.0)


def holder(fence: int) -> LockInfo:
    return LockInfo(KEY, fence, 10.0, "host", 1, "other", "tests.job", 0.0, 0.0)


def count(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def runs(held: Lease, value: Any = "ok", stored: bool = True) -> list[tuple[Any, Any]]:
    """The steps of a held job whose body returns `value` and whose commit is stored."""
    return [(Keep(held), None), (RunBody, value), (Drop(held), None), (Commit, stored)]


# -- the happy path ----------------------------------------------------------------------


def test_a_job_runs_in_two_round_trips_and_commits_its_record() -> None:
    held = lease()
    s = run_flow(job())
    out = s.run((Begin, held), *runs(held, {"n": 1}))
    assert out == Outcome("ran", {"n": 1}, 7)
    begin, commit = s.of(Begin)[0], s.of(Commit)[0]
    assert (begin.key, begin.record, begin.fingerprint) == (KEY, True, FP)
    assert commit == Commit(held, "DONE", '{"n":1}', FP, 600.0)
    assert s.notes == ["started", "done"]
    (run_body,) = s.of(RunBody)
    assert (run_body.ctx.lease, run_body.ctx.key, run_body.ctx.task_id) == (held, KEY, ME)


def test_job_flow_is_the_job_run() -> None:
    held = lease()
    flow = job_flow(spec_for(), backoff=Backoff(), redelivery=Redelivery())
    assert Script(flow).run((Begin, held), *runs(held)).status == "ran"


# -- busy: another delivery holds the key -------------------------------------------------


def test_busy_skip_is_a_duplicate_naming_the_holder() -> None:
    metrics = Metrics()
    s = run_flow(job(metrics))
    out = s.run((Begin, Busy(12.0, "other", FP)))
    assert out == Outcome("duplicate", DUPLICATE, holder="other")
    assert count(metrics, "jobfence_conflicts_total", task="tests.job", policy="skip") == 1
    assert s.notes == ["conflict"] and not s.of(RunBody)


def test_busy_raise_raises_duplicate_job() -> None:
    with pytest.raises(DuplicateJob):
        run_flow(job(on_conflict="raise")).run((Begin, Busy(12.0, "other", FP)))


def test_busy_retry_comes_back_after_the_holders_lease() -> None:
    out = run_flow(job(on_conflict="retry")).run((Begin, Busy(12.0, "other", FP)))
    assert out.status == "retry" and 12.0 <= out.countdown <= 12.1


def test_busy_wait_waits_for_the_release_then_runs() -> None:
    held = lease()
    s = run_flow(job(on_conflict="wait"))
    out = s.run((Begin, Busy(0.004, "other", FP)), (WaitRelease, None), (Begin, held), *runs(held))
    assert out.status == "ran"
    (wait,) = s.of(WaitRelease)
    assert wait.key == KEY and 0.001 <= wait.timeout <= 0.005  # bounded by the holder's TTL


def test_a_wait_notes_one_conflict_per_holder_not_one_per_look() -> None:
    """Each look of a wait's loop noted a conflict: a waiter behind a long run wrote one per
    backoff step, pushing the decisions worth explaining out of the key's bounded log."""
    metrics, held = Metrics(), lease()
    s = run_flow(job(metrics, on_conflict="wait"))
    looks = [(Begin, Busy(5.0, "first", FP)), (WaitRelease, None)] * 3
    looks += [(Begin, Busy(5.0, "second", FP)), (WaitRelease, None)] * 2
    out = s.run(*looks, (Begin, held), *runs(held))
    assert out.status == "ran"
    assert s.notes.count("conflict") == 2  # one for each holder waited on
    assert count(metrics, "jobfence_conflicts_total", task="tests.job", policy="wait") == 2


def passes(seconds: float) -> Any:
    """A reply that takes `seconds` of the script's clock (a wait that ran its course)."""

    def reply(script: Script, _op: Any) -> None:
        script.now += seconds

    return reply


def test_busy_wait_times_out_at_wait_timeout() -> None:
    metrics = Metrics()
    s = run_flow(job(metrics, on_conflict="wait", wait_timeout=5.0))
    with pytest.raises(AcquireTimeout, match="still running after 5s"):
        s.run((Begin, Busy(20.0, "other", FP)), (WaitRelease, passes(6.0)),
              (Begin, Busy(20.0, "other", FP)))  # fmt: skip
    assert count(metrics, "jobfence_acquire_timeouts_total", task="tests.job") == 1


@pytest.mark.parametrize("how", [{"lock_until": "start"}, {"queues": True}])
def test_busy_retry_behind_the_holder_requeues(how: dict[str, Any]) -> None:
    s = run_flow(job(on_conflict="retry", **how))
    out = s.run((Begin, Busy(12.0, "other", "")))
    assert out.status == "requeue" and out.reason == "another run of the key holds it"
    assert out.countdown >= 12.0 and s.notes == ["conflict", "queued"]


def test_busy_wait_past_its_timeout_queues_behind_the_holder_through_the_broker() -> None:
    s = run_flow(job(on_conflict="wait", wait_timeout=0.0, queues=True))
    assert s.run((Begin, Busy(12.0, "other", FP))).status == "requeue"


def test_our_own_earlier_delivery_holding_it_defers_this_copy() -> None:
    metrics = Metrics()
    s = run_flow(job(metrics, on_conflict="raise"))
    out = s.run((Begin, Busy(9.0, ME, FP)))
    assert out.status == "defer" and out.countdown >= 9.0  # never dropped: the holder may be dead
    assert s.notes == ["defer"] and count(metrics, "jobfence_conflicts_total", task="tests.job",
                                          policy="raise") == 0  # fmt: skip


# -- replay and conflict -----------------------------------------------------------------


def test_a_done_record_replays_its_result_without_running() -> None:
    metrics = Metrics()
    s = run_flow(job(metrics))
    assert s.run((Begin, record({"n": 2}, fence=4))) == Outcome("replayed", {"n": 2}, 4)
    assert s.notes == ["replayed"] and not s.of(RunBody)
    assert count(metrics, "jobfence_idempotent_replays_total", task="tests.job") == 1


def test_a_record_of_other_arguments_is_a_conflict() -> None:
    with pytest.raises(IdempotencyConflict, match="different arguments") as caught:
        run_flow(job()).run((Begin, record(fingerprint="fp-other", fence=4)))
    assert caught.value.fence == 4


def test_a_running_job_of_other_arguments_is_a_conflict() -> None:
    with pytest.raises(IdempotencyConflict, match="running job"):
        run_flow(job()).run((Begin, Busy(5.0, "other", "fp-other")))


def test_per_run_an_earlier_runs_record_is_not_replayed_the_run_takes_the_lock() -> None:
    held = lease()
    s = run_flow(job(lock_until="start"))
    out = s.run((Begin, record(fingerprint=f"{FP}#earlier-task")), (Begin, held), *runs(held))
    first, second = s.of(Begin)
    assert (first.record, second.record) == (True, False)
    run_fp = f"{FP}#{ME}"  # the record names the run
    assert second.fingerprint == run_fp and s.of(Commit)[0].fingerprint == run_fp
    assert out.status == "ran"


def test_per_run_a_running_copy_of_other_arguments_is_busy_not_a_conflict() -> None:
    out = run_flow(job(lock_until="start")).run((Begin, Busy(5.0, "other", "fp-other#x")))
    assert out.status == "duplicate"


def test_a_done_record_under_the_previous_secret_answers_with_our_fingerprint() -> None:
    held = lease()
    s = run_flow(job(previous=(("old-key", "old-fp"),)))
    out = s.run((Begin, held), (Inspect("old-key"), None),
                (ReadRecord("old-key"), record("old", fingerprint="old-fp")),
                (Release(held), True))  # fmt: skip
    assert out == Outcome("replayed", "old", 5)


# -- a key-secret rotation: two grants of one job, one under each secret -----------------
# KEY ("job-key") sorts before "old-key" and after "a-old-key": the grant under the greater
# key keeps its lease, whichever secret a worker calls current.


def test_the_lock_under_the_previous_secret_is_looked_at_before_its_record() -> None:
    # A run under the other secret that commits (record written, lock freed in one step)
    # between the two looks is seen by one of them: looked at lock first, it is seen.
    held = lease()
    s = run_flow(job(previous=(("old-key", "old-fp"),)))
    out = s.run((Begin, held), (Inspect("old-key"), None),
                (ReadRecord("old-key"), record("old", fingerprint="old-fp")),
                (Release(held), True))  # fmt: skip
    assert out.status == "replayed" and not s.of(RunBody)


def test_a_grant_under_the_lesser_key_yields_to_the_other_secrets_holder() -> None:
    held = lease()
    s = run_flow(job(previous=(("old-key", "old-fp"),)))
    out = s.run((Begin, held), (Inspect("old-key"), holder(3)), (Release(held), True))
    assert out.status == "duplicate" and out.holder == "other"
    assert not s.of(ReadRecord) and not s.of(RunBody)


def test_a_grant_under_the_greater_key_waits_for_the_other_grant_to_go_then_runs() -> None:
    # The other grant's worker sees ours and gives its grant back: neither may skip both.
    held = lease()
    s = run_flow(job(previous=(("a-old-key", "old-fp"),)))
    out = s.run((Begin, held), (Inspect("a-old-key"), holder(3)),
                (Inspect("a-old-key"), None), (ReadRecord("a-old-key"), None),
                *runs(held))  # fmt: skip
    assert out.status == "ran" and len(s.of(RunBody)) == 1
    assert s.of(Sleep) and not s.of(Release)


def test_a_grant_under_the_greater_key_replays_the_other_grants_run() -> None:
    held = lease()
    s = run_flow(job(previous=(("a-old-key", "old-fp"),)))
    out = s.run((Begin, held), (Inspect("a-old-key"), holder(3)), (Inspect("a-old-key"), None),
                (ReadRecord("a-old-key"), record("old", fingerprint="old-fp")),
                (Release(held), True))  # fmt: skip
    assert out == Outcome("replayed", "old", 5) and not s.of(RunBody)


def stays(script: Script, _op: Inspect) -> LockInfo:
    script.now += ROTATION_GRACE  # the other grant stayed all the while
    return holder(3)


def test_a_grant_under_the_greater_key_comes_back_later_if_the_other_stays() -> None:
    # The other grant runs its body (or its worker stalls): this copy is never acked as its
    # duplicate, as that grant may yet yield to ours; it comes back and replays or runs.
    held = lease()
    s = run_flow(job(previous=(("a-old-key", "old-fp"),)))
    out = s.run((Begin, held), (Inspect("a-old-key"), holder(3)), (Inspect("a-old-key"), stays),
                (Release(held), True))  # fmt: skip
    assert out.status == "requeue" and out.countdown >= 10.0  # the holder's lease left
    assert s.notes == ["queued"] and not s.of(RunBody)


def test_per_run_a_record_of_another_run_under_the_previous_secret_does_not_answer() -> None:
    held = lease()
    s = run_flow(job(lock_until="start", previous=(("old-key", "old-fp"),)))
    out = s.run((Begin, held), (Inspect("old-key"), None),
                (ReadRecord("old-key"), record(fingerprint="old-fp#earlier-task")),
                *runs(held))  # fmt: skip
    assert out.status == "ran"


def test_per_run_our_own_copy_under_the_other_secret_defers_this_one() -> None:
    own = LockInfo("old-key", 3, 10.0, "host", 1, ME, "tests.job", 0.0, 0.0)
    held = lease()
    s = run_flow(job(lock_until="start", previous=(("old-key", "old-fp"),)))
    out = s.run((Begin, held), (Inspect("old-key"), own), (Release(held), True))
    assert out.status == "defer" and s.notes == ["defer"]


def test_wait_waits_for_the_other_secrets_holder_not_for_our_own_key() -> None:
    held, again = lease(), lease(fence=8)
    s = run_flow(job(on_conflict="wait", previous=(("old-key", "old-fp"),)))
    out = s.run((Begin, held), (Inspect("old-key"), holder(3)), (Release(held), True),
                (WaitRelease, None), (Begin, again), (Inspect("old-key"), None),
                (ReadRecord("old-key"), None), *runs(again))  # fmt: skip
    assert out.status == "ran"
    assert [w.key for w in s.of(WaitRelease)] == ["old-key"]


# -- the lock server unavailable ---------------------------------------------------------


def test_a_lost_reply_at_begin_redelivers_without_running() -> None:
    s = run_flow(job())
    out = s.run((Begin, BackendUnavailable("timed out")))
    assert out.status == "redeliver" and out.fence is None and out.countdown > 0
    assert out.reason == "lock server unavailable before the body ran"
    assert s.notes == ["redeliver"] and not s.of(RunBody)


def test_past_the_redelivery_limit_the_job_is_recorded_failed_and_raises() -> None:
    metrics = Metrics()
    fresh = lease(fence=9)
    s = run_flow(job(metrics, limit=2, redeliveries=2))
    with pytest.raises(RedeliveryLimitReached, match="given up after 2 redeliveries"):
        s.run((Begin, BackendUnavailable("down")), (Begin, fresh), (Commit, True))
    commit = s.of(Commit)[0]
    assert commit.lease is fresh and commit.state == "FAILED"
    assert json.loads(commit.result)["error"] == "RedeliveryLimitReached"
    assert count(metrics, "jobfence_executions_total", task="tests.job", outcome="given_up") == 1


def test_giving_up_replays_a_done_record_found_at_the_last_look() -> None:
    s = run_flow(job(limit=0))
    out = s.run((Begin, BackendUnavailable("down")), (Begin, record("ok", fence=3)))
    assert out == Outcome("replayed", "ok", 3)


def test_giving_up_with_a_live_holder_is_a_duplicate() -> None:
    s = run_flow(job(limit=0))
    out = s.run((Begin, BackendUnavailable("down")), (Begin, Busy(4.0, "other")))
    assert out == Outcome("duplicate", DUPLICATE, holder="other")


def test_giving_up_with_the_server_still_down_raises_all_the_same() -> None:
    with pytest.raises(RedeliveryLimitReached):
        run_flow(job(limit=0)).run((Begin, BackendUnavailable("down")),
                                   (Begin, BackendUnavailable("down")))  # fmt: skip


# -- the commit: lost replies ------------------------------------------------------------


def test_a_lost_commit_reply_is_sent_again_and_a_repeat_finding_no_lock_reads_our_record() -> None:
    held = lease(fence=7)
    down = BackendUnavailable("timed out")
    s = run_flow(job())
    out = s.run(
        (Begin, held), (Keep(held), None), (RunBody, "ok"), (Drop(held), None),
        *[(Commit, down)] * COMMIT_ATTEMPTS,  # the lease still lasts: go on
        (Commit, False),  # the first one ran: no lock left
        (ReadRecord(KEY), record("ok", fence=7)),  # ... and the record is ours
    )  # fmt: skip
    assert out == Outcome("ran", "ok", 7) and s.notes[-1] == "done"
    assert len(s.of(Sleep)) == COMMIT_ATTEMPTS


def test_a_commit_unanswered_past_the_lease_redelivers_commit_outcome_unknown() -> None:
    held = lease(fence=7, left=0.0)  # its time is up (drift aside) by the third attempt
    s = run_flow(job())
    s.now = 1000.0
    down = BackendUnavailable("timed out")
    out = s.run((Begin, held), (Keep(held), None), (RunBody, "ok"), (Drop(held), None),
                *[(Commit, down)] * COMMIT_ATTEMPTS)  # fmt: skip
    assert out.status == "redeliver" and out.reason == "commit outcome unknown"
    assert out.fence == 7 and "done" not in s.notes


def test_a_repeat_commit_finding_another_record_is_superseded_by_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    held = lease(fence=7)
    s = run_flow(job())
    out = s.run((Begin, held), (Keep(held), None), (RunBody, "ok"), (Drop(held), None),
                (Commit, BackendUnavailable("x")), (Commit, False),
                (ReadRecord, record(fence=8)),  # not ours: a newer holder's ...
                (Drop(held), None), (ReadRecord(KEY), record(fence=8)),  # ... is the proof
                (Drop(held), None), (Release(held), False))  # fmt: skip
    assert out.status == "superseded" and out.fence == 7
    assert s.notes[-2:] == ["commit_refused", "superseded"] and "done" not in s.notes
    assert any("record not stored" in r.getMessage() for r in caplog.records)


# -- the commit refused: the lease was gone before it --------------------------------------


def test_a_commit_refused_without_proof_is_delivered_again_never_reported_done() -> None:
    held = lease(fence=7)
    metrics = Metrics()
    s = run_flow(job(metrics))
    out = s.run((Begin, held), *runs(held, "ok", stored=False),  # force-released mid-body
                (Drop(held), None), (ReadRecord(KEY), None), (Inspect(KEY), None),
                (Drop(held), None), (Release(held), False))  # fmt: skip
    assert out.status == "redeliver" and out.fence == 7
    assert out.reason == "lease lost before commit; DONE record not stored"
    assert s.notes == ["started", "commit_refused", "redeliver"]
    assert count(metrics, "jobfence_executions_total", task="tests.job", outcome="done") == 0
    assert count(metrics, "jobfence_executions_total", task="tests.job", outcome="lease_lost") == 1


@pytest.mark.parametrize(
    "proof", [[(ReadRecord(KEY), record())], [(ReadRecord(KEY), None), (Inspect(KEY), holder(8))]]
)
def test_a_commit_refused_with_a_newer_holder_in_sight_is_superseded(
    proof: list[tuple[Any, Any]],
) -> None:
    held = lease(fence=7)
    metrics = Metrics()
    s = run_flow(job(metrics))
    out = s.run((Begin, held), *runs(held, "ok", stored=False), (Drop(held), None), *proof,
                (Drop(held), None), (Release(held), False))  # fmt: skip
    assert out.status == "superseded" and out.fence == 7
    assert s.notes == ["started", "commit_refused", "superseded"]
    assert count(metrics, "jobfence_executions_total", task="tests.job", outcome="done") == 0


def test_a_commit_refused_under_on_lease_lost_drop_is_dropped_not_done() -> None:
    held = lease(fence=7)
    s = run_flow(job(on_lease_lost="drop"))
    out = s.run((Begin, held), *runs(held, "ok", stored=False), (Drop(held), None),
                (ReadRecord, None), (Inspect, None), (Drop(held), None),
                (Release(held), False))  # fmt: skip
    assert out.status == "dropped" and s.notes == ["started", "commit_refused"]


@pytest.mark.parametrize(
    ("stored", "reason"),
    [(True, ""), (False, "record not stored: lease lost")],
)
def test_a_failed_body_says_whether_its_failed_record_was_stored(stored: bool, reason: str) -> None:
    held = lease()
    s = run_flow(job())
    with pytest.raises(ValueError):
        s.run((Begin, held), (Keep(held), None), (RunBody, ValueError("boom")),
              (Drop(held), None), (Commit, stored))  # fmt: skip
    (failed,) = [op for op in s.ops if isinstance(op, Event) and op.kind == "failed"]
    assert failed.reason == reason


def test_a_body_its_effects_answered_from_their_done_rows_is_noted() -> None:
    held = lease()

    def answered(_s: Script, op: RunBody) -> str:
        op.ctx.effect_opened(True)  # SqlEffects found the job's own DONE row
        return "ok"

    s = run_flow(job())
    out = s.run((Begin, held), (Keep(held), None), (RunBody, answered), (Drop(held), None),
                (Commit, True))  # fmt: skip
    assert out.status == "ran" and s.notes == ["started", "effect_replayed", "done"]


# -- the body: failures, lost leases, stale fences ----------------------------------------


def test_a_failing_body_is_recorded_failed_and_raised() -> None:
    held = lease()
    metrics = Metrics()
    s = run_flow(job(metrics))
    with pytest.raises(ValueError, match="boom"):
        s.run((Begin, held), (Keep(held), None), (RunBody, ValueError("boom")),
              (Drop(held), None), (Commit, True))  # fmt: skip
    commit = s.of(Commit)[0]
    assert commit.state == "FAILED" and json.loads(commit.result) == {"error": "ValueError"}
    assert s.notes == ["started", "failed"]
    assert count(metrics, "jobfence_executions_total", task="tests.job", outcome="failed") == 1


def test_an_unstorable_result_is_a_failure_that_releases_the_lease() -> None:
    held = lease()
    s = run_flow(job())
    with pytest.raises(Exception, match="result"):
        s.run((Begin, held), (Keep(held), None), (RunBody, object()), (Drop(held), None),
              (Commit, True))  # fmt: skip
    assert s.of(Commit)[0].state == "FAILED"


def test_a_passthrough_exception_releases_without_a_record() -> None:
    class Retry(Exception):
        pass

    held = lease()
    s = run_flow(job(), passthrough=(Retry,))
    with pytest.raises(Retry):
        s.run((Begin, held), (Keep(held), None), (RunBody, Retry()), (Drop(held), None),
              (Release(held), True))  # fmt: skip
    assert not s.of(Commit) and s.notes == ["started", "released"]


def test_a_stale_fence_is_proof_of_a_newer_holder_superseded() -> None:
    held = lease()
    metrics = Metrics()
    s = run_flow(job(metrics))
    out = s.run((Begin, held), (Keep(held), None),
                (RunBody, StaleFence(resource="r", fence=7, last=8)),
                (Drop(held), None), (Release(held), False))  # fmt: skip
    assert out.status == "superseded" and out.fence == 7 and s.notes[-1] == "stale"
    assert count(metrics, "jobfence_stale_fence_total", task="tests.job") == 1
    assert not s.of(ReadRecord) and not s.of(Commit)


@pytest.mark.parametrize(
    "proof", [[(ReadRecord(KEY), record())], [(ReadRecord(KEY), None), (Inspect(KEY), holder(8))]]
)
def test_a_lost_lease_with_a_newer_holder_is_superseded(proof: list[tuple[Any, Any]]) -> None:
    held = lease(fence=7)
    s = run_flow(job())
    out = s.run((Begin, held), (Keep(held), None), (RunBody, LeaseLost("lost", key=KEY)),
                (Drop(held), None), *proof, (Drop(held), None), (Release(held), False))  # fmt: skip
    assert out.status == "superseded" and s.notes[-1] == "superseded"


@pytest.mark.parametrize("look", [holder(7), None, BackendUnavailable("down")])
def test_a_lost_lease_without_proof_redelivers(look: Any) -> None:
    held = lease(fence=7)
    s = run_flow(job())
    steps = [(ReadRecord, BackendUnavailable("down"))] if isinstance(look, Exception) else [
        (ReadRecord, None), (Inspect, look)]  # our own grant, or none: no proof  # fmt: skip
    out = s.run((Begin, held), (Keep(held), None), (RunBody, LeaseLost("lost", key=KEY)),
                (Drop(held), None), *steps, (Drop(held), None), (Release(held), False))  # fmt: skip
    assert out.status == "redeliver" and out.reason == "lease lost without proof of a newer holder"
    assert s.notes[-2:] == ["lease_lost", "redeliver"]


def test_a_lost_lease_under_on_lease_lost_drop_is_dropped() -> None:
    held = lease(fence=7)
    s = run_flow(job(on_lease_lost="drop"))
    out = s.run((Begin, held), (Keep(held), None), (RunBody, LeaseLost("lost", key=KEY)),
                (Drop(held), None), (ReadRecord, None), (Inspect, None), (Drop(held), None),
                (Release(held), False))  # fmt: skip
    assert out.status == "dropped" and out.fence == 7


def test_an_effects_commit_outcome_unknown_redelivers() -> None:
    held = lease()
    s = run_flow(job())
    out = s.run((Begin, held), (Keep(held), None),
                (RunBody, CommitOutcomeUnknown("lost", reason="OperationalError")),
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out.status == "redeliver" and out.reason == "effect commit outcome unknown"


def test_an_effect_inside_a_callers_open_transaction_releases_and_records_after_it() -> None:
    held = lease()

    def body_joins_an_open_transaction(_s: Script, op: RunBody) -> str:
        op.ctx.join_outer()  # its commit comes later, or a rollback
        return "ok"

    s = run_flow(job())
    out = s.run((Begin, held), (Keep(held), None), (RunBody, body_joins_an_open_transaction),
                (Drop(held), None), (Release(held), True), (AfterOuterCommit, None))  # fmt: skip
    assert out == Outcome("ran", "ok", 7)
    assert not s.of(Commit) and s.notes == ["started", "released"]
    assert s.of(AfterOuterCommit)[0].result == '"ok"'


def test_the_record_after_the_callers_commit_is_best_effort() -> None:
    fresh = lease(fence=11)
    s = Script(job().record_done('"ok"'))
    assert s.run((Begin, fresh), (Commit(fresh, "DONE", '"ok"', FP, 600.0), True)) is None
    assert s.notes == ["done"]
    s = Script(job().record_done('"ok"'))
    assert s.run((Begin, BackendUnavailable("down"))) is None and s.notes == []


# -- data loss and the crash cap ----------------------------------------------------------


def test_after_a_flushall_a_crash_suspect_delivery_gets_a_fresh_grant_and_is_counted() -> None:
    fresh = lease(fence=1)  # the fence counter went with the data: a fresh grant
    s = run_flow(job(suspect=True, max_crashed=2))
    out = s.run((Begin, fresh), (CountDelivery, 1), *runs(fresh))
    (counted,) = s.of(CountDelivery)
    assert counted.key.startswith(KEY + "#run:") and ME not in counted.key  # a digest, per run
    assert out.status == "ran"


def test_a_crash_count_at_the_cap_still_runs() -> None:
    held = lease()
    s = run_flow(job(suspect=True, max_crashed=2))
    assert s.run((Begin, held), (CountDelivery, 2), *runs(held)).status == "ran"


def test_a_crash_count_that_cannot_be_read_runs_the_body_all_the_same() -> None:
    held = lease()
    s = run_flow(job(suspect=True, max_crashed=2))
    out = s.run((Begin, held), (CountDelivery, BackendUnavailable("x")), *runs(held))
    assert out.status == "ran"


def test_past_the_crash_cap_the_job_is_poisoned_recorded_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    held = lease()
    metrics = Metrics()
    s = run_flow(job(metrics, suspect=True, max_crashed=2))
    with pytest.raises(PoisonMessage, match="gave up after 2 deliveries"):
        s.run((Begin, held), (CountDelivery, 3), (Drop(held), None), (Commit, True))
    assert json.loads(s.of(Commit)[0].result)["error"] == "PoisonMessage"
    assert not s.of(RunBody) and not s.of(Keep)
    assert any("dead-letter" in r.getMessage() for r in caplog.records)
    assert count(metrics, "jobfence_executions_total", task="tests.job", outcome="poisoned") == 1


def test_another_copy_of_a_poisoned_job_is_refused_too(caplog: pytest.LogCaptureFixture) -> None:
    held = lease()
    s = run_flow(job(suspect=True, max_crashed=2))
    with pytest.raises(PoisonMessage):
        s.run((Begin, held), (CountDelivery, 5), (Drop(held), None), (Commit, True))
    assert not any(r.getMessage().startswith("dead-letter:") for r in caplog.records)  # once
    assert any("another copy" in r.getMessage() for r in caplog.records)


# -- the concurrency slot ----------------------------------------------------------------


def test_a_slot_is_taken_under_the_lease_kept_tied_to_it_and_given_back_after_the_commit() -> None:
    held, slot = lease(), slot_lease()
    s = run_flow(job(concurrency=1, concurrency_key="group"))
    out = s.run((Begin, held), (Keep(held), None), (TakeSlot, slot), (Keep(slot, tie=held), None),
                (RunBody, "ok"), (Drop(held), None), (Commit, True), (Drop(slot), None),
                (Release(slot), True))  # fmt: skip
    assert out.status == "ran"
    assert s.of(RunBody)[0].ctx.slot is slot


def test_no_slot_in_time_releases_the_lease_and_requeues() -> None:
    held = lease()
    s = run_flow(job(concurrency=1, concurrency_key="group", wait_timeout=0.0))
    out = s.run((Begin, held), (Keep(held), None), (TakeSlot, SlotWait(2, 5.0)),
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out.status == "requeue" and out.reason == "no concurrency slot free"
    assert 1.0 <= out.countdown <= 2.0 and not s.of(RunBody)


def test_a_queued_slot_waiter_leaves_the_queue_when_the_server_goes() -> None:
    held = lease()
    s = run_flow(job(concurrency=1, concurrency_key="group", wait_timeout=5.0))
    out = s.run((Begin, held), (Keep(held), None), (TakeSlot, SlotWait(0, 5.0)),
                (TakeSlot, BackendUnavailable("down")), (LeaveSlot, None),
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out.status == "redeliver" and out.fence is None


def test_a_slot_given_back_after_a_failing_body() -> None:
    held, slot = lease(), slot_lease()
    s = run_flow(job(concurrency=1, concurrency_key="group"))
    with pytest.raises(RuntimeError):
        s.run((Begin, held), (Keep(held), None), (TakeSlot, slot), (Keep(slot, tie=held), None),
              (RunBody, RuntimeError("x")), (Drop(held), None), (Commit, True),
              (Drop(slot), None), (Release(slot), BackendUnavailable("down")))  # fmt: skip


# -- the global rate limit ---------------------------------------------------------------


def rated(**overrides: Any) -> Job:
    fields: dict[str, Any] = {"key": "rate:t", "label": "tests.job", "interval": 1.0}
    fields.update(overrides)
    return job(rate=RateSpec(**fields))


def test_a_near_turn_is_slept_out_then_the_start_admitted() -> None:
    held = lease()
    s = run_flow(rated())
    out = s.run((Begin, held), (Keep(held), None),
                (TakeRate("rate:t", 1.0, 1, RATE_HORIZON), RateGrant(True, 0.5, 50.0)),
                (TakeRate("rate:t" + START_SUFFIX, 1.0, 1, 1.0), RateGrant(True, 0.0, 50.5)),
                (RunBody, "ok"), (Drop(held), None), (Commit, True))  # fmt: skip
    assert out.status == "ran" and s.now == 1000.5  # the wait slept here


def test_a_far_turn_is_reserved_and_the_job_comes_back_for_it() -> None:
    held = lease()
    s = run_flow(rated())
    out = s.run((Begin, held), (Keep(held), None), (TakeRate, RateGrant(True, 30.0, 50.0)),
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out == Outcome("rate_limited", countdown=30.0, reason="rate limit", slot=80.0)


def test_a_turn_beyond_the_horizon_is_refused_nothing_reserved() -> None:
    held = lease()
    s = run_flow(rated())
    out = s.run((Begin, held), (Keep(held), None), (TakeRate, RateGrant(False, 5000.0, 50.0)),
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out == Outcome("rate_limited", countdown=5000.0, reason="rate limit")


def test_a_skip_limited_job_is_skipped() -> None:
    held = lease()
    s = run_flow(rated(on_limited="skip"))
    out = s.run((Begin, held), (Keep(held), None),
                (TakeRate("rate:t", 1.0, 1, 0.0), RateGrant(False, 0.75, 50.0)),
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out.status == "rate_skipped" and out.value["retry_after"] == 0.75


def test_a_copy_early_for_its_reserved_turn_comes_back_again_spending_no_turn() -> None:
    held = lease()
    s = run_flow(rated(slot=80.0))
    out = s.run((Begin, held), (Keep(held), None),
                (TakeRate("rate:t", 1.0, 1, -1), RateGrant(False, 0.0, 70.0)),  # a look only
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out.status == "rate_limited" and out.slot == 80.0 and out.countdown == 10.0


def test_starts_running_late_take_a_new_turn() -> None:
    held = lease()
    s = run_flow(rated())
    out = s.run((Begin, held), (Keep(held), None), (TakeRate, RateGrant(True, 0.0, 50.0)),
                (TakeRate, RateGrant(False, 3.0, 50.0)),  # the starts are behind
                (TakeRate("rate:t", 1.0, 1, RATE_HORIZON), RateGrant(True, 4.0, 50.0)),
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out.status == "rate_limited" and out.slot == 54.0


def test_the_rate_server_unavailable_redelivers_with_the_lease_released() -> None:
    held = lease()
    s = run_flow(rated())
    out = s.run((Begin, held), (Keep(held), None), (TakeRate, BackendUnavailable("down")),
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out.status == "redeliver" and not s.of(RunBody)


# -- the publish claim at start ----------------------------------------------------------


def test_a_copy_whose_claim_another_publish_took_is_superseded_never_run() -> None:
    held = lease()
    s = run_flow(job(supersede=True, publish_claim=True))
    out = s.run((Begin, held), (SwapPublish(KEY, ME, "!" + ME, 60.0), "newer-task"),
                (Drop(held), None), (Release(held), True))  # fmt: skip
    assert out == Outcome("superseded", {"jobfence": "superseded"}, 7, holder="newer-task")
    assert not s.of(RunBody)


def test_a_replaced_copy_finding_the_replacements_record_is_superseded() -> None:
    s = run_flow(job(supersede=True, publish_claim=True))
    out = s.run((Begin, record(fingerprint="fp-new")), (SwapPublish, "!newer-task"))
    assert out == Outcome("superseded", {"jobfence": "superseded"}, None, holder="newer-task")


def test_unique_for_a_run_within_the_window_is_throttled() -> None:
    held = lease()
    metrics = Metrics()
    s = run_flow(job(metrics, unique_for=60.0))
    out = s.run((Begin, held), (SwapPublish, "!earlier-task"), (Drop(held), None),
                (Release(held), True))  # fmt: skip
    assert out.status == "duplicate" and out.holder == "earlier-task"
    assert count(metrics, "jobfence_conflicts_total", task="tests.job", policy="unique_for") == 1


def test_unique_for_a_run_sets_its_window_after_its_record() -> None:
    held = lease()
    s = run_flow(job(unique_for=60.0))
    out = s.run((Begin, held), (SwapPublish, None), *runs(held),
                (SwapPublish(KEY, "!" + ME, "!" + ME, 60.0), BackendUnavailable("x")))  # fmt: skip
    assert out.status == "ran"  # the job is done; only the throttle is lost


def test_lock_until_start_drops_the_claim_when_the_body_starts() -> None:
    held = lease()
    s = run_flow(job(lock_until="start", publish_claim=True))
    out = s.run((Begin, held), (Keep(held), None), (SwapPublish(KEY, ME, None, 60.0), None),
                (RunBody, 1), (Drop(held), None), (Commit, True))  # fmt: skip
    assert out.status == "ran"


def test_a_claim_that_cannot_be_checked_redelivers_never_run_on_a_guess() -> None:
    held = lease()
    s = run_flow(job(supersede=True, publish_claim=True))
    out = s.run((Begin, held), (SwapPublish, BackendUnavailable("down")), (Drop(held), None),
                (Release(held), BackendUnavailable("down")))  # fmt: skip
    assert out.status == "redeliver" and not s.of(RunBody)
