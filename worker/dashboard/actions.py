"""The dashboard's action tokens and action log: each confirmation page's form carries a token,
an HMAC over the action, the lock id, the fence and the browser's own cookie, good once and for
TOKEN_TTL seconds; every action taken or refused is logged (who, what, when, what came of it)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass

COOKIE = "jobfence_dash"  # the browser's random id, which action tokens are bound to
TOKEN_TTL = 600.0  # seconds a confirmation page's token stays good


@dataclass(frozen=True)
class ActionRecord:
    """One action in the log: who, what, when, and what came of it (no key: its label)."""

    when: float
    user: str
    action: str
    lock: str
    fence: int
    outcome: str


class ActionTokens:
    """Mints and checks action tokens under one secret; remembers each spent token's nonce
    until the token expires, so a replayed form is refused."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self._used: dict[str, float] = {}  # nonces of tokens spent, until they expire
        self._lock = threading.Lock()

    def mint(self, action: str, lock_id: str, fence: int, cookie: str) -> str:
        issued, nonce = f"{time.time():.0f}", secrets.token_hex(8)
        return f"{issued}.{nonce}.{self._mac(action, lock_id, fence, cookie, issued, nonce)}"

    def _mac(self, *parts: object) -> str:
        msg = "\n".join(str(p) for p in parts).encode()
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()

    def check(self, token: str, cookie: str, action: str, lock_id: str, fence: int) -> str:
        """Empty if `token` is good for this action, lock, fence and browser (`cookie`), and
        spends it; else why not."""
        issued, _, rest = token.partition(".")
        nonce, _, mac = rest.partition(".")
        if not (token and cookie and issued.isdigit()):
            return "the form's cross-site token is missing; open the confirmation page again"
        if not hmac.compare_digest(mac, self._mac(action, lock_id, fence, cookie, issued, nonce)):
            return "the form's cross-site token is not valid for this lock and browser"
        now = time.time()
        if now - int(issued) > TOKEN_TTL:
            return "the confirmation page has expired; open it again"
        with self._lock:
            for old in [n for n, t in self._used.items() if t < now]:
                del self._used[old]
            if nonce in self._used:
                return (
                    "this form was submitted already (a replay); open the confirmation page again"
                )
            self._used[nonce] = int(issued) + TOKEN_TTL
        return ""
