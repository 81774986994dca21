"""The Sentinel master watch's epoch moves on a change of master only, never at its first answer."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from jobfence.locks.backends.redis.sentinel_watch import MasterWatch
from jobfence.locks.clock import SYSTEM_CLOCK
from jobfence.locks.errors import BackendUnavailable

OLD = ("127.0.0.1", 7001)
NEW = ("127.0.0.1", 7002)


class _Backend:
    """What the watch asks of its backend: the sentinels' answer, given to two callers at
    once (both answered before either records it), and the pool it points."""

    def __init__(self, answer: tuple[int, tuple[str, int]]) -> None:
        self.answer = answer
        self.asked = threading.Barrier(2, timeout=5)
        self.clock = SYSTEM_CLOCK
        self.service = "mymaster"
        self.confirmed: list[list[Any]] = []
        self.client = SimpleNamespace(
            connection_pool=SimpleNamespace(get_master_address=lambda: None)
        )

    def discover(self) -> tuple[int, tuple[str, int]]:
        answer = self.answer
        self.asked.wait()
        return answer

    def confirm_on_new_master(self, leases: list[Any]) -> None:
        self.confirmed.append(leases)


def _two_polls_at_once(watch: MasterWatch) -> None:
    threads = [threading.Thread(target=watch.poll) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)


def test_two_first_answers_at_once_leave_the_epoch_where_a_call_read_it() -> None:
    """The caller's first poll and the watch thread's, answered together: a call sent under
    the epoch read after the caller's own poll is confirmed (it failed with "the sentinels
    named a new master during the call" on a loaded machine, with no failover)."""
    backend = _Backend((1, OLD))
    watch = MasterWatch(backend)  # type: ignore[arg-type]
    _two_polls_at_once(watch)
    assert watch.address == OLD
    watch.confirm(0, "begin", None)  # no change of master: the call stands
    assert backend.confirmed == []


def test_control_a_new_master_moves_the_epoch_and_a_call_in_flight_fails() -> None:
    backend = _Backend((1, OLD))
    watch = MasterWatch(backend)  # type: ignore[arg-type]
    _two_polls_at_once(watch)
    epoch = watch.epoch
    backend.answer = (2, NEW)
    _two_polls_at_once(watch)
    assert watch.address == NEW
    assert watch.epoch > epoch
    with pytest.raises(BackendUnavailable, match="named a new master during the call"):
        watch.confirm(epoch, "begin", None)
    assert backend.confirmed == [[]]
