"""Fleet-wide rate limits: the GCRA, rate strings ("100/m"), and a plain-Python limiter.

The algorithm is GCRA (the generic cell rate algorithm, a token bucket stored as one
number). Each limiter key holds one timestamp, the theoretical arrival time `tat` of the
next event. With `interval = period / count` and `tau = (burst - 1) * interval`, an event
at server time `now` is admitted when `max(tat, now) - tau <= now`, and then
`tat = max(tat, now) + interval`. Why GCRA: one key and one number per limiter whatever
the rate (a sliding-window log stores every event), exact spacing, and the whole decision
is one atomic step on the lock server. Every step reads the SERVER's clock (Redis TIME,
PostgreSQL clock_timestamp(), MariaDB NOW(6)), so the workers' clocks never matter.

Guarantee: over any window of length W, at most `W / interval + burst` events are admitted
(for "100/m" and burst 1: at most 100·W/60 + 1). `burst` is how many events may start
at once after an idle spell; burst 1 spaces every event exactly `interval` apart.

A caller willing to wait (`max_wait > 0`) reserves its turn in the same step: it is told
to wait `wait` seconds and then act. A reservation never given back stays unused (the
limiter errs below the rate, never above).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from jobfence.locks.backend import LockBackend, RateGrant, validate_seconds
from jobfence.locks.drive import run_sync
from jobfence.locks.errors import LockError, RateLimited, RateLimitUnsupported
from jobfence.locks.flows import rate_flow
from jobfence.locks.registry import backends_with

if TYPE_CHECKING:
    from jobfence.tasks.metrics import Metrics

P = ParamSpec("P")
R = TypeVar("R")

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*([smh])\s*$")
RATE_FORMAT = '"N/s", "N/m" or "N/h" with N > 0, e.g. "100/m"'


@dataclass(frozen=True)
class Rate:
    """`count` events per `period` seconds, `burst` of them at once after an idle spell."""

    count: float
    period: float
    burst: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.count < math.inf or not 0 < self.period < math.inf:
            raise LockError(f"a rate needs count > 0 and period > 0, got {self}")
        if not isinstance(self.burst, int) or isinstance(self.burst, bool) or self.burst < 1:
            raise LockError(f"burst must be a whole number >= 1, got {self.burst!r}")

    @property
    def interval(self) -> float:
        """Seconds between two events at the steady rate."""
        return self.period / self.count

    @property
    def per_second(self) -> float:
        return self.count / self.period

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "m", 3600.0: "h"}.get(self.period, f"{self.period:g}s")
        return f"{self.count:g}/{unit}"


def parse_rate(text: object, *, option: str = "rate", burst: int = 1) -> Rate:
    """`"100/m"` -> Rate(100, 60). Refuses anything else, naming `option` and the format."""
    if isinstance(text, Rate):
        return text
    match = _RATE.match(text) if isinstance(text, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise LockError(f"{option} must be {RATE_FORMAT}; got {text!r}")
    return Rate(float(match.group(1)), _UNITS[match.group(2)], burst)


def gcra(
    tat: float, now: float, interval: float, burst: int, max_wait: float
) -> tuple[bool, float, float]:
    """One GCRA step: (admitted, wait, new tat); the reference the server scripts follow.

    All in one unit (the backends use µs). Refused (wait > max_wait, or max_wait < 0):
    tat is unchanged and `wait` says how long until one event would be admitted at once.
    """
    start = tat if tat > now else now
    wait = start - (burst - 1) * interval - now
    if wait < 0:
        wait = 0.0
    if max_wait < 0 or wait > max_wait:
        return False, wait, tat
    return True, wait, start + interval


class RateLimiter:
    """A limiter shared by every process that uses the same backend and key.

        stripe = locker.rate_limiter("api:stripe", "100/m")
        with stripe:                      # blocks until our turn (at most `timeout`)
            call_stripe()
        if stripe.try_acquire() == 0:     # never blocks; else the seconds to wait
            call_stripe()
        @stripe                           # the same, as a decorator
        def charge(...): ...
    """

    def __init__(
        self,
        backend: LockBackend,
        key: str,
        rate: str | Rate,
        *,
        burst: int = 1,
        timeout: float | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        if not backend.capabilities.rate_limit:
            raise RateLimitUnsupported(
                f"the {backend.name} lock backend keeps no shared rate limits; use "
                f"{backends_with('rate_limit')}",
                key=key,
            )
        self.backend = backend
        self.key = key
        self.rate = parse_rate(rate, option="rate", burst=burst) if isinstance(rate, str) else rate
        if timeout is not None:
            validate_seconds(timeout, "timeout")
        self.timeout = timeout
        self.metrics = metrics

    def take(self, max_wait: float) -> RateGrant:
        """One step on the server: admitted within `max_wait` (reserved), or refused."""
        return self.backend.take_rate(self.key, self.rate.interval, self.rate.burst, max_wait)

    def try_acquire(self) -> float:
        """0.0 if admitted now; else the seconds until a try would succeed (nothing taken)."""
        grant = self.take(0.0)
        if grant.admitted:
            self._waited(0.0)
            return 0.0
        self._denied("try")
        return max(grant.wait, 1e-6)

    def acquire(self, timeout: float | None = None) -> float:
        """Wait for our turn, up to `timeout` seconds (None: the limiter's default, else no
        bound). Returns the seconds waited; raises RateLimited if the turn is further away.

        One round trip: the turn is reserved on the server, then slept out here.
        """
        timeout = self.timeout if timeout is None else timeout
        flow = rate_flow(self.key, self.rate, timeout=timeout)
        try:
            grant = run_sync(flow, self.backend, self.backend.clock)
        except RateLimited:
            self._denied("raise")
            raise
        self._waited(grant.wait)
        return grant.wait

    def __enter__(self) -> RateLimiter:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Decorator: each call waits for its turn first."""

        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            self.acquire()
            return fn(*args, **kwargs)

        return inner

    def _waited(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.rate_limit_waited(self.key, seconds)

    def _denied(self, action: str) -> None:
        if self.metrics is not None:
            self.metrics.rate_limit_denied(self.key, action)
