"""Redlock's rounds: what a flow yields to its driver, and how a majority is read from the
replies (the base every grant, extend, release and publish flow is built on)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

from jobfence.locks.backend import JobRecord
from jobfence.locks.backends.redis.url import tls_hint
from jobfence.locks.backends.redlock.masters import Master
from jobfence.locks.backends.redlock.protocol import NO_REPLY, ErrorReply, pack
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.keys import KeySpace

SIGNAL_LIFETIME_MS = 2000

Decide = Callable[[dict[int, Any], int], bool]
T = TypeVar("T")


def never(replies: dict[int, Any], pending: int) -> bool:
    """A round that reads every target's reply, up to its deadline."""
    return False


@dataclass(frozen=True)
class Round:
    """One command sent to some masters at once, and how long their replies are awaited.

    Every Redlock operation is a generator of rounds (`Rounds`): it yields a Round, gets
    back a reply (or NO_REPLY) per target master, and returns its answer. The quorum, the
    validity, the fence and the clean-up are decided there once; the sync backend
    (`RedlockBackend._run`) and the asyncio store (store_async.py) only carry rounds.
    """

    payload: bytes
    deadline: float  # time.monotonic(); 0: send and do not wait (a clean-up on the way out)
    decided: Decide = never  # stop reading once it says so, before the deadline
    targets: Sequence[int] | None = None  # None: every master


Rounds: TypeAlias = Generator[Round, Any, T]


@dataclass(frozen=True)
class Done(Generic[T]):
    """A flow of rounds that has returned its value."""

    value: T


def advance(flow: Rounds[T], replies: Any, error: BaseException | None) -> Round | Done[T]:
    """The next round of `flow` after `replies` (or with `error` thrown in), or its value.
    A driver throws what its I/O raised (a cancellation, Ctrl-C) so the flow cleans up."""
    try:
        return flow.send(replies) if error is None else flow.throw(error)
    except StopIteration as stop:
        return Done(stop.value)


class QuorumRounds:
    """The payload of a script, one round to every master, and a majority read from its
    replies: what the grant's and every other op's flows share (grant.py, flows.py)."""

    keys: KeySpace
    masters: list[Master]
    quorum: int
    sha: dict[str, str]
    socket_timeout: float

    def _evalsha(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> bytes:
        return pack("EVALSHA", self.sha[script], len(keys), *keys, *args)

    def _io_deadline(self, started: float) -> float:
        return started + self.socket_timeout

    def _unavailable(
        self, what: str, replies: dict[int, Any], key: str | None
    ) -> BackendUnavailable:
        errors = [v for v in replies.values() if isinstance(v, ErrorReply)]
        answered = sum(1 for v in replies.values() if v is not NO_REPLY)
        detail = f" (a master said: {errors[0]})" if errors else ""
        silent = [i for i, v in replies.items() if v is NO_REPLY]
        return BackendUnavailable(
            f"redlock {what}: {answered} of {len(self.masters)} masters answered, "
            f"a majority of {self.quorum} is needed{detail}{self._why(errors, silent)}",
            key=key,
        )

    def _why(self, errors: Sequence[str], silent: Sequence[int]) -> str:
        """'; <what to fix>' when the masters' error replies or the failed connections of
        the silent ones say (TLS, a login: waiting will not help), else ''."""
        causes = [*(Exception(e) for e in errors),
                  *(e for i in silent if (e := self.masters[i].last_error) is not None)]
        hint = next((h for c in causes if (h := tls_hint(c)) is not None), None)
        return f"; {hint}" if hint else ""

    def _count(self, replies: dict[int, Any], ok: Callable[[Any], bool]) -> tuple[int, int]:
        """(masters whose reply passes `ok`, masters that gave no usable reply)."""
        good = sum(1 for v in replies.values() if v is not NO_REPLY and ok(v))
        silent = sum(1 for v in replies.values() if v is NO_REPLY or isinstance(v, ErrorReply))
        return good, silent

    def _everywhere(
        self, payload: bytes, *, ok: Callable[[Any], bool] | None = None
    ) -> Rounds[dict[int, Any]]:
        """One round to every master. With `ok`, stop once a majority passed it or cannot."""
        q, decided = self.quorum, never
        if ok is not None:
            passes = ok

            def majority_told(replies: dict[int, Any], pending: int) -> bool:
                good = sum(1 for v in replies.values() if v is not NO_REPLY and passes(v))
                return good >= q or good + pending < q

            decided = majority_told
        replies: dict[int, Any] = yield Round(payload, self._io_deadline(time.monotonic()), decided)
        return replies

    def _majority(
        self, payload: bytes, key: str | None, what: str, ok: Callable[[Any], bool]
    ) -> Rounds[bool]:
        """True if a majority passed `ok`; raises BackendUnavailable if it cannot be told."""
        replies = yield from self._everywhere(payload, ok=ok)
        good, silent = self._count(replies, ok)
        if good >= self.quorum:
            return True
        if good + silent >= self.quorum:
            raise self._unavailable(what, replies, key)
        return False

    def _quorum_of(
        self, what: str, replies: dict[int, Any], key: str | None, usable: Callable[[Any], bool]
    ) -> list[Any]:
        """The replies that pass `usable`; BackendUnavailable unless a majority does."""
        answers = [v for v in replies.values() if usable(v)]
        if len(answers) < self.quorum:
            raise self._unavailable(what, replies, key)
        return answers


def row_of(n: int) -> Callable[[Any], bool]:
    """A master's reply that is a list of `n` values (a script's or HMGET's row)."""
    return lambda v: type(v) is list and len(v) == n


def is_answer(value: Any) -> bool:
    """A master's usable answer: neither silence nor an error reply."""
    return value is not NO_REPLY and type(value) is not ErrorReply


def record_of(reply: list[Any]) -> JobRecord:
    """The job record in a master's reply row: (kind, state, fingerprint, result, fence,
    finished ms)."""
    _, state, fingerprint, result, fence, finished_ms = (str(x or "") for x in reply)
    return JobRecord(
        state=state,
        fingerprint=fingerprint,
        result=result,
        fence=int(fence or 0),
        finished_at=int(finished_ms or 0) / 1000,
    )
