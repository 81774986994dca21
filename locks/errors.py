"""Lock and fencing errors; each carries the key, the fence and the cause where known."""

from __future__ import annotations

from jobfence.config.errors import JobfenceError


class KeyedError(JobfenceError):
    """An error about one key: `key` is the lock or job key, `fence` the token involved."""

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        fence: int | None = None,
        cause: BaseException | None = None,
    ) -> None:
        self.key = key
        self.fence = fence
        self.cause = cause
        parts = [message]
        if key is not None:
            parts.append(f"key={key}")
        if fence is not None:
            parts.append(f"fence={fence}")
        if cause is not None:
            parts.append(f"cause={type(cause).__name__}: {cause}")
        super().__init__(" ".join(parts))


class LockError(KeyedError):
    """A lock operation failed (never a task-layer error: those are TaskError)."""


class AcquireTimeout(LockError):
    """A blocking acquire did not get the lease before its deadline."""


class LeaseLost(LockError):
    """The lease expired, could not be extended, or was taken by another owner."""


class NotOwner(LeaseLost):
    """Release or extend found another owner (or none) on the key: nothing was changed."""


class BackendUnavailable(LockError):
    """The lock server could not be reached or answered with an error."""


class StaleFence(LockError):
    """A write carried a fencing token lower than one the resource already accepted."""

    def __init__(
        self, *, resource: str, fence: int, last: int | None, cause: BaseException | None = None
    ) -> None:
        self.resource = resource
        self.last = last
        super().__init__(
            f"stale fencing token for resource {resource!r}: {fence} < last accepted {last}",
            key=resource,
            fence=fence,
            cause=cause,
        )


class StaleFenceOutcomeUnknown(StaleFence):
    """A fenced write's reply was lost, and by the resend a newer fence had been accepted.

    The lost attempt may have applied before the newer holder wrote (as an older holder's
    write may always land first); what is certain is that a newer holder exists.
    """


class FencedWriteRefused(LockError):
    """A fenced write was refused before anything was written; the fence is unchanged.

    `index` is the 1-based position of the command that would have failed (None when the
    write id was already used under this fence with other commands), `reason` says why.
    """

    def __init__(self, *, resource: str, fence: int, index: int | None, reason: str) -> None:
        self.resource = resource
        self.index = index
        self.reason = reason
        where = f"command {index}" if index is not None else "write"
        super().__init__(
            f"fenced write refused, nothing written: {where}: {reason}", key=resource, fence=fence
        )


class PartialFencedWrite(LockError):
    """A fenced write failed part way: commands 1..index-1 were applied, the rest were not.

    Raised for an error the guard's check cannot foresee. The fence was advanced and the
    answer is stored: a resend under the same fence and write id raises this again and
    applies nothing. `replies` holds the replies of the applied commands.
    """

    def __init__(
        self, *, resource: str, fence: int, index: int, reason: str, replies: list[object]
    ) -> None:
        self.resource = resource
        self.index = index
        self.reason = reason
        self.replies = replies
        applied = f"commands 1..{index - 1} applied" if index > 1 else "no command applied"
        super().__init__(
            f"fenced write failed part way: {applied}, command {index} failed ({reason}), "
            "the rest not run",
            key=resource,
            fence=fence,
        )


class SemaphoreUnsupported(LockError):
    """The lock backend keeps no semaphores; the message names the backends that do."""

class RateLimited(LockError):
    """A rate limiter refused an event: admitting it would break the limit within the
    time the caller was willing to wait. `retry_after` is the wait it would have needed."""

    def __init__(self, message: str, *, key: str | None = None, retry_after: float = 0.0) -> None:
        self.retry_after = retry_after
        super().__init__(f"{message} (retry after {retry_after:.3f}s)", key=key)


class RateLimitUnsupported(LockError):
    """The lock backend keeps no shared rate limits (its `capabilities.rate_limit` is false)."""


class CommitOutcomeUnknown(LockError):
    """The connection was lost inside an effect's transaction (nothing committed) or at its
    COMMIT, and no record settled whether it landed. The job is delivered again: the next
    delivery finds the DONE row, or runs the effect (fenced), so the job is never dropped and
    never takes effect twice. `reason` names what was lost (an exception type), never the
    statement or its parameters."""

    def __init__(self, message: str, *, key: str | None = None, fence: int | None = None,
                 reason: str = "") -> None:  # fmt: skip
        self.reason = reason
        super().__init__(f"{message} ({reason})" if reason else message, key=key, fence=fence)
