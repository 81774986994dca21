"""The Redlock masters' wire: RESP2 commands out, replies in, and what a connection owes."""

from __future__ import annotations

from typing import Any


class ErrorReply(str):
    """An error reply from a master (a script error, NOSCRIPT, READONLY ...)."""


class _Missing:
    """No reply from a master: it was down, the connection broke, or the deadline passed."""

    def __repr__(self) -> str:
        return "<no reply>"


NO_REPLY: Any = _Missing()
MORE = object()  # the buffer ends inside a reply


def parse(buf: bytearray, pos: int) -> tuple[Any, int] | object:
    """One RESP2 reply from `buf` at `pos`: (value, next position), or MORE if incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return MORE
    kind = buf[pos]
    if kind == 0x2A:  # '*' array
        n = int(buf[pos + 1 : end])
        if n < 0:
            return None, end + 2
        items: list[Any] = []
        pos = end + 2
        for _ in range(n):
            got = parse(buf, pos) if buf[pos : pos + 1] == b"*" else _scalar(buf, pos)
            if not isinstance(got, tuple):
                return MORE
            items.append(got[0])
            pos = got[1]
        return items, pos
    return _scalar(buf, pos)


def _scalar(buf: bytearray, pos: int) -> tuple[Any, int] | object:
    """One reply that is not an array: integer, bulk or simple string, or error."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return MORE
    kind = buf[pos]
    if kind == 0x3A:  # ':' integer
        return int(buf[pos + 1 : end]), end + 2
    if kind == 0x24:  # '$' bulk string
        n = int(buf[pos + 1 : end])
        if n < 0:
            return None, end + 2
        start = end + 2
        if len(buf) < start + n + 2:
            return MORE
        return buf[start : start + n].decode(), start + n + 2
    if kind == 0x2B:  # '+' simple string
        return buf[pos + 1 : end].decode(), end + 2
    if kind == 0x2D:  # '-' error
        return ErrorReply(buf[pos + 1 : end].decode()), end + 2
    raise ValueError(f"unexpected reply type {chr(kind)!r} from a redlock master")


def pack(*args: Any) -> bytes:
    """One command (str and int arguments) in RESP2."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else b"%d" % arg
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


class Replies:
    """What one connection to a master has read, and how many replies it still owes.

    Commands go out without waiting for earlier replies (a master that is slow to answer
    keeps receiving them, in order, on this one connection), so what was sent to a master
    runs there in the order sent, even when the client stopped waiting: a release sent after
    an acquire it never saw answered still removes that acquire's key. The sync backend's
    sockets and the asyncio store's connections (store_async.py) both read through this.
    """

    __slots__ = ("buf", "owed")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.owed = 0

    def take(self) -> Any:
        """The next complete reply in the buffer, or MORE."""
        got = parse(self.buf, 0)
        if not isinstance(got, tuple):
            return MORE
        del self.buf[: got[1]]
        self.owed -= 1
        return got[0]


def is_noscript(value: Any) -> bool:
    """A master that lost its scripts (SCRIPT FLUSH, a restart): load them and resend."""
    return isinstance(value, ErrorReply) and value.startswith("NOSCRIPT")
