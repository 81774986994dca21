"""What every fence guard checks of its arguments before it writes: a resource name and a fence."""

from __future__ import annotations

from jobfence.locks.errors import LockError


def check_args(resource: str, fence: int) -> None:
    """Refuse a resource SQL cannot key or a fence a signed BIGINT cannot hold."""
    if not isinstance(resource, str) or not resource or len(resource) > 255:
        raise LockError(f"resource must be a string of 1..255 characters, got {resource!r}")
    # SQL keeps fences in a signed BIGINT; refuse what it cannot hold rather than fail there.
    if not isinstance(fence, int) or isinstance(fence, bool) or not 0 <= fence < 2**63:
        raise LockError(
            f"fence must be an int in [0, 2**63) (lease.fence), got {fence!r}", key=resource
        )
