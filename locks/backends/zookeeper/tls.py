"""TLS refusals: a set-up to fix (told apart from an outage to wait out), and its fix."""

from __future__ import annotations

import ssl
from typing import Any

from jobfence.locks.errors import LockError


class TLSRefused(LockError):
    """The TLS session with ZooKeeper was refused, by the server or by this client: a set-up
    to fix, no outage to wait out. The message says `problem` and `fix`; never a password."""

    def __init__(self, problem: str, fix: str, *, cause: BaseException | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; fix: {fix}", cause=cause)


def tls_problem(exc: BaseException, where: str, tls: dict[str, Any]) -> tuple[str, str] | None:
    """(problem, fix) if `exc`, a failed connection attempt to `where` (host:port), was a TLS
    session refused, else None (a server down, a dropped connection: waited out).

    kazoo retries such an attempt until the connect timeout and then says only "Connection
    time-out"; the cause is the ssl.SSLError behind its ConnectionDropped. Messages name the
    lock URL's option to change (kazoo's spellings) and ZooKeeper's setting on the other side.
    """
    error = _ssl_error(exc)
    if error is None:
        return None
    if isinstance(error, ssl.SSLCertVerificationError):
        return _certificate_problem(error, where)
    reason = str(getattr(error, "reason", None) or error).replace("_", " ").lower()
    client_cert = (
        "pass a client certificate signed by a CA in the server's ssl.trustStore: "
        "certfile=/path/client.pem&keyfile=/path/client.key in the lock URL"
    )
    if any(m in reason for m in ("bad certificate", "certificate required", "unknown ca",
                                 "handshake failure", "access denied",
                                 "certificate unknown")):  # fmt: skip
        had = "the one given" if tls.get("certfile") else "none was given"
        return (
            f"ZooKeeper at {where} refused the TLS session ({reason}): it requires a client "
            f"certificate it trusts (ssl.clientAuth=need) and {had} is not",
            client_cert,
        )
    if isinstance(error, ssl.SSLEOFError) or "eof" in reason or "wrong version" in reason:
        return (
            f"ZooKeeper at {where} closed the TLS handshake ({reason}): that port may be its "
            "plain clientPort, not its secureClientPort, or it wants a client certificate",
            "put the server's secureClientPort in the lock URL; if it is that port, "
            + client_cert,
        )
    return (
        f"TLS to ZooKeeper at {where} failed ({reason})",
        "check the lock URL's ca=, certfile= and keyfile= (PEM files; the key unencrypted)",
    )


def _ssl_error(exc: BaseException) -> ssl.SSLError | None:
    """The innermost ssl.SSLError among `exc` and its causes (eight at most), if any."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    errors = [e for e in seen if isinstance(e, ssl.SSLError)]
    return errors[-1] if errors else None


def _certificate_problem(error: ssl.SSLCertVerificationError, where: str) -> tuple[str, str]:
    """(problem, fix) of a server certificate this client refused: its host name, or its CA."""
    why = error.verify_message or "untrusted"
    if error.verify_code == 62 or "mismatch" in why.lower():  # X509_V_ERR_HOSTNAME_MISMATCH
        host = where.rpartition(":")[0].strip("[]")
        return (
            f"ZooKeeper's TLS certificate at {where} is not valid for host {host!r} ({why})",
            "connect by a name or address the certificate holds (the lock URL's host); or, "
            "a downgrade the start-up check warns about, add check_hostname=false to the "
            "lock URL",
        )
    return (
        f"ZooKeeper's TLS certificate at {where} did not verify ({why})",
        "pass the CA that signed it as ca=/path/ca.pem in the lock URL (the CA of the "
        "server's ssl.keyStore certificate)",
    )
