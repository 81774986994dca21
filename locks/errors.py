"""Lock and fencing errors; each carries the key, the fence and the cause where known."""

from __future__ import annotations

from jobfence.config.errors import JobfenceError


class LockError(JobfenceError):
    """A lock operation failed. `key` is the lock key, `fence` the token involved."""

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
