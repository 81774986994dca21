"""The demo's journal is executor middleware: each decision of a real run counted in Redis."""

from __future__ import annotations

from demo.journal import RedisJournal, read
from jobfence.locks import Backoff, LeaseKeeper, MemoryBackend
from jobfence.tasks.executor import Executor
from tests.tasks.conftest import spec_for, unique


def test_the_journal_counts_each_decision_of_a_run_by_job_key(redis_url: str) -> None:
    """The server is the session's (emptied before each test): nothing to clean up but ours."""
    keeper = LeaseKeeper()
    journal = RedisJournal(redis_url)
    executor = Executor(MemoryBackend(), keeper, backoff=Backoff(0.001, 0.01), tracing=False)
    executor.use(journal)
    key = unique("tests.journal:k")
    try:
        assert executor.run(spec_for(key, task_id="t1"), lambda _ctx: 1).status == "ran"
        assert executor.run(spec_for(key, task_id="t2"), lambda _ctx: 1).status == "replayed"
        counts = read(redis_url)
    finally:
        keeper.stop()
        journal.client.close()
    assert {event: n[key] for event, n in counts.items() if key in n} == {
        "started": 1,
        "done": 1,
        "replayed": 1,
    }
