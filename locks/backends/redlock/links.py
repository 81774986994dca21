"""The sync backend's driver of a round: the command sent on one link per master at once,
the replies read with poll() as they come, until the round is decided or its deadline."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Sequence
from typing import Any

from jobfence.locks.backends.redlock.masters import RECONNECT_DELAY, Link, Master
from jobfence.locks.backends.redlock.protocol import MORE, NO_REPLY, is_noscript
from jobfence.locks.backends.redlock.rounds import Round

# How the masters are asked in parallel: each master has plain non-blocking sockets of ours
# (one per concurrent operation), a command is sent to every master, then poll() reads the
# replies as they come. No thread pool: on the hot path a hand-off to threads costs more
# than the round trip, and a fork never inherits a pool. Not redis-py's connections: their
# reads block one connection at a time and drop the connection on a timeout, which would
# lose the order of commands to a slow master (protocol.Replies) and the replies still on their way.

#: Replies a connection may owe (commands sent to a master that has not answered yet) before
#: it is dropped: a master that far behind is treated as down.
MAX_OWED = 64


def checkout(masters: Sequence[Master]) -> list[Link | None]:
    """One link per master for one operation; links whose master closed them are renewed."""
    pid = os.getpid()
    links = [m.checkout(pid) for m in masters]
    poller = select.poll()
    for link in links:
        if link is not None and not link.owed:
            poller.register(link.fd, select.POLLIN)
    # Something to read on a link that owes nothing: the master closed it (restart,
    # idle timeout) or it is out of step. Replace it now, before a command is lost.
    for fd, _ in poller.poll(0):
        i = next(j for j, lk in enumerate(links) if lk is not None and lk.fd == fd)
        stale = links[i]
        assert stale is not None
        if stale.tls and stale.recv() is None:
            continue  # a TLS message with no data for us (a session ticket): not stale
        stale.close()
        links[i] = None
        try:
            links[i] = masters[i].connect()
        except OSError:
            masters[i].down_until = time.monotonic() + RECONNECT_DELAY
    return links


def checkin(masters: Sequence[Master], links: list[Link | None]) -> None:
    """Give the links back to their masters, closing those that owe too many replies."""
    pid = os.getpid()
    for master, link in zip(masters, links, strict=True):
        if link is not None:
            if link.owed > MAX_OWED:
                link.close()
            else:
                master.checkin(link, pid)


def carry(masters: Sequence[Master], links: list[Link | None], step: Round) -> dict[int, Any]:
    """Send the round's payload to every target master, then read replies until it is
    decided or its deadline. Returns a reply (or NO_REPLY) per target; masters still
    silent keep owing theirs on their link."""
    payload = step.payload
    replies: dict[int, Any] = {}
    waiting: dict[int, int] = {}  # fd -> master
    poller = select.poll()
    for i in range(len(links)) if step.targets is None else step.targets:
        link = links[i]
        if link is None or not link.send(payload):
            if link is not None:
                _drop(masters, links, i)
            replies[i] = NO_REPLY
            continue
        waiting[link.fd] = i
        poller.register(link.fd, select.POLLIN)
    reloaded: set[int] = set()
    while waiting and not step.decided(replies, len(waiting)):
        left = step.deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(left * 1000):
            i = waiting[fd]
            value = _read(masters, links, i, payload, reloaded)
            if value is not MORE:
                replies[i] = value
                del waiting[fd]
                poller.unregister(fd)
    for i in waiting.values():
        replies[i] = NO_REPLY
    return replies


def _read(
    masters: Sequence[Master],
    links: list[Link | None],
    i: int,
    payload: bytes,
    reloaded: set[int],
) -> Any:
    """What master `i`'s link has for us: the awaited reply, NO_REPLY if the link
    broke, or MORE if it is still on its way (earlier replies are read and dropped)."""
    link = links[i]
    assert link is not None
    data = link.recv()
    if data is None:
        return MORE
    if not data:  # closed or reset: whatever it owed is lost
        return _drop(masters, links, i)
    link.buf += data
    while link.owed:
        try:
            value = link.take()
        except ValueError:  # not RESP: the stream is out of step
            return _drop(masters, links, i)
        if value is MORE or link.owed:  # incomplete, or a reply nobody waits for
            if value is MORE:
                return MORE
            continue
        if not is_noscript(value) or i in reloaded:
            masters[i].last_error = None
            return value
        # The master lost its scripts (SCRIPT FLUSH): load them and resend, in order
        # on the same link.
        reloaded.add(i)
        loads = masters[i].script_loads()
        if not link.send(b"".join([*loads, payload])):
            return _drop(masters, links, i)
        link.owed += len(loads)  # one send, but a reply per command
    return MORE


def _drop(masters: Sequence[Master], links: list[Link | None], i: int) -> Any:
    """Close master `i`'s broken link (keeping why, for the hint); NO_REPLY."""
    link = links[i]
    if link is not None:
        if link.error is not None:  # why, for BackendUnavailable's hint
            masters[i].last_error = link.error
        link.close()
    links[i] = None
    return NO_REPLY
