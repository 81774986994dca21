"""The rate limiter contract: GCRA steps on the server clock, shared by every client."""

from __future__ import annotations

import threading
import uuid

import pytest

from jobfence.locks import LockBackend, RateLimiter, RateLimitUnsupported
from tests.contract.conftest import BackendHarness


def _key() -> str:
    return f"rate:{uuid.uuid4().hex[:8]}"


@pytest.fixture
def rated(harness: BackendHarness) -> BackendHarness:
    if not harness.backend.capabilities.rate_limit:
        pytest.skip(f"{harness.name} keeps no rate limits (refusal tested apart)")
    return harness


def test_backend_without_the_capability_refuses_a_limiter(backend: LockBackend) -> None:
    if backend.capabilities.rate_limit:
        pytest.skip("this backend keeps rate limits")
    with pytest.raises(RateLimitUnsupported, match="keeps no shared rate limits"):
        RateLimiter(backend, "api", "10/s")
    with pytest.raises(RateLimitUnsupported):
        backend.take_rate("api", 0.1, 1, 0.0)


def test_one_step_spaces_bursts_reserves_and_is_shared_by_every_client(
    rated: BackendHarness,
) -> None:
    b, other = rated.backend, rated.another_client()
    key = _key()  # the second event waits one interval, also for another client
    first, second = b.take_rate(key, 10.0, 1, 0.0), other.take_rate(key, 10.0, 1, 0.0)
    assert first.admitted and first.wait == 0
    assert not second.admitted and 9.0 < second.wait <= 10.0
    assert abs(second.now - first.now) < 5.0  # both on the server clock, seconds apart at most

    key = _key()  # a burst of 3 at once, then spaced
    assert [b.take_rate(key, 10.0, 3, 0.0).admitted for _ in range(4)] == [True] * 3 + [False]

    key = _key()  # a wait within max_wait is reserved; a refusal reserves nothing
    waits = [b.take_rate(key, 10.0, 1, 25.0) for _ in range(3)]
    assert [g.admitted for g in waits] == [True, True, True]
    assert waits[0].wait == 0 and 9.0 < waits[1].wait <= 10.0 and 19.0 < waits[2].wait <= 20.0
    refused, again = b.take_rate(key, 10.0, 1, 25.0), b.take_rate(key, 10.0, 1, 25.0)
    assert not refused.admitted and 29.0 < refused.wait <= 30.0
    assert not again.admitted and again.wait <= refused.wait
    peek = b.take_rate(_key(), 10.0, 1, -1.0)
    assert not peek.admitted and peek.wait == 0  # a negative max_wait only looks
    unbounded = RateLimiter(b, _key(), "5/s")  # no timeout: any wait is accepted
    assert unbounded.acquire() == 0.0
    unbounded.acquire()  # waited its turn (≤ 0.2 s)
    assert unbounded.take(float("inf")).wait > 0.02  # reserved the next, ~0.2 s out


def test_racing_clients_never_exceed_the_rate_on_the_server_clock(
    rated: BackendHarness,
) -> None:
    """Four clients hammer one limiter of 40/s for ~0.6 s; the admitted events' server times
    are the proof: no window of 0.5 s holds more than 0.5 * 40 + 1 of them."""
    key, interval = _key(), 1 / 40
    clients = [rated.another_client() for _ in range(4)]
    starts: list[float] = []
    guard = threading.Lock()
    stop = threading.Event()

    def hammer(b: LockBackend) -> None:
        while not stop.is_set():
            g = b.take_rate(key, interval, 1, 0.0)
            if g.admitted:
                with guard:
                    starts.append(g.now)

    threads = [threading.Thread(target=hammer, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    stop.wait(0.6)
    stop.set()
    for t in threads:
        t.join()
    starts.sort()
    span = starts[-1] - starts[0]
    assert len(starts) >= span / interval * 0.8, "the limiter admitted far less than its rate"
    worst = max(sum(1 for s in starts[i:] if s < t0 + 0.5) for i, t0 in enumerate(starts))
    assert worst <= 0.5 / interval + 1
