"""Eviction notices on Redis: a grant removed by its fence (`ReleaseGrant`, supersede) is
published on the prefix's channel, and a keeper's watcher hears it at once, so the evicted
lease's keeper extends it now and finds it gone, instead of at its next extension."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from jobfence.locks.outage import OUTAGE

log = logging.getLogger(__name__)

#: How long one wait for a notice lasts (seconds): the watcher looks at its stop flag so often.
POLL = 0.5
#: After the subscription failed (the server away), the next try follows this long after.
RETRY = 0.5

Heard = Callable[[str, int], None]


def notice(fence: int | str, key: str) -> str:
    """The message release_grant.lua publishes: the fence, a space, the job's key."""
    return f"{fence} {key}"


def parse_notice(data: bytes | str) -> tuple[str, int] | None:
    """(key, fence) of a notice; None for anything else on the channel."""
    text = data.decode() if isinstance(data, bytes) else data
    fence, _, key = text.partition(" ")
    return (key, int(fence)) if fence.isdigit() and key else None


class EvictionWatch:
    """One thread subscribed to `channel` on `client`, handing each notice to `heard`;
    subscribed again after a failure, until stopped."""

    def __init__(self, client: redis.Redis, channel: str, heard: Heard) -> None:
        self.client = client
        self.channel = channel
        self.heard = heard
        self._stop = threading.Event()
        self.subscribed = threading.Event()  # set while a subscription stands (for tests)
        self._thread = threading.Thread(target=self._run, name="jobfence-evictions", daemon=True)

    def start(self) -> EvictionWatch:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            try:
                pubsub.subscribe(self.channel)
                self.subscribed.set()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=POLL)
                    if message is not None and message.get("type") == "message":
                        parsed = parse_notice(message["data"])
                        if parsed is not None:
                            self.heard(*parsed)
            except redis.exceptions.NoPermissionError:
                log.warning("eviction notices on %s: this ACL user may not subscribe to the "
                            "channel; evicted leases are found at their next extension "
                            "(grant it with &%s)", self.channel, self.channel)  # fmt: skip
                return
            except Exception as exc:  # the server away: a lease is still found at extension
                self.subscribed.clear()
                OUTAGE.warning(log, "eviction notices on %s interrupted (%s); subscribing "
                               "again", self.channel, type(exc).__name__)  # fmt: skip
                self._stop.wait(RETRY)
            finally:
                self.subscribed.clear()
                pubsub.close()
