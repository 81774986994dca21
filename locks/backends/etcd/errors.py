"""What goes wrong talking to etcd: the gateway's errors, SetupError, and the (problem, fix)
of a TLS or login set-up etcd refuses."""

from __future__ import annotations

import ssl

from jobfence.locks.backends.etcd.target import USERINFO_FIX
from jobfence.locks.errors import LockError

# gRPC status codes the gateway reports in its error bodies.
NOT_FOUND = 5  # e.g. "requested lease not found": nothing was applied
INVALID_ARGUMENT = 3
FAILED_PRECONDITION = 9
UNAVAILABLE = 14
PERMISSION_DENIED = 7


class GatewayError(Exception):
    """The gateway answered with an error (HTTP status, gRPC code, message)."""

    def __init__(self, status: int, code: int, message: str) -> None:
        self.status = status
        self.code = code
        self.message = message
        super().__init__(f"HTTP {status}, code {code}: {message}")

    @property
    def surely_not_applied(self) -> bool:
        """Errors etcd raises before it applies anything (bad request, unknown lease)."""
        return self.code in (NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION)


class Unreachable(Exception):
    """No endpoint could be reached; the request was never sent (nothing applied)."""


class TLSFailed(Unreachable):
    """The TLS handshake failed or the server refused it (no client certificate): nothing
    was applied. The ssl error is the `__cause__`."""


class AuthFailed(GatewayError):
    """etcd refused the user name and password (/v3/auth/authenticate)."""


class OutcomeUnknown(Exception):
    """The request may have reached etcd, but no answer came back (timeout, reset)."""


class SetupError(LockError):
    """etcd refused the TLS session or the login: a set-up to fix, no outage to wait out.
    The message says `problem` and `fix`; it never holds the password or a token."""

    def __init__(self, problem: str, fix: str, *, key: str | None = None,
                 cause: BaseException | None = None) -> None:  # fmt: skip
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; fix: {fix}", key=key, cause=cause)


def setup_problem(
    exc: BaseException, where: str, user: str | None, prefix: str
) -> tuple[str, str] | None:
    """(problem, fix) if `exc` says the TLS or login set-up at `where` (a member, host:port)
    cannot work for `user` on the keys under `prefix`, else None."""
    if isinstance(exc, GatewayError) and "CommonName of client" in exc.message:
        return (f"etcd at {where} refuses a client certificate with a Common Name on "
                "its JSON gateway while authentication is on (the CN would not be "
                "used as the user)",
                "issue the client certificate (cert= in the lock URL) with no CN, "
                "naming the client in a subject alternative name, and authenticate "
                "as user:password@ in the URL")  # fmt: skip
    if isinstance(exc, AuthFailed):
        return (f"etcd at {where} refused the login of user {user!r} ({exc.message})",
                "check the user and password in the lock URL: " + USERINFO_FIX)  # fmt: skip
    if isinstance(exc, GatewayError):
        no_user = "user name is empty" in exc.message or (
            exc.code == PERMISSION_DENIED and user is None
        )
        if no_user and user is None:
            return (f"etcd at {where} has authentication on and the lock URL names no user "
                    f"({exc.message})",
                    "put a user and password in the lock URL: " + USERINFO_FIX)  # fmt: skip
        if exc.code == PERMISSION_DENIED:
            return (f"etcd at {where} denies user {user!r} the keys under "
                    f"'{prefix}/' ({exc.message})",
                    f"grant the user a role with readwrite on that prefix: etcdctl role "
                    f"grant-permission ROLE readwrite --prefix=true '{prefix}/'; etcdctl "
                    "user grant-role USER ROLE")  # fmt: skip
        return None
    if isinstance(exc, TLSFailed):
        return _tls_problem(exc, where)
    return None


def _tls_problem(exc: TLSFailed, where: str) -> tuple[str, str]:
    """(problem, fix) for a TLS session etcd or this client refused."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    text = " ".join(str(e) for e in seen)
    verify = [e for e in seen if isinstance(e, ssl.SSLCertVerificationError)]
    host = where.rpartition(":")[0]
    detail = f"{type(seen[-1]).__name__}: {seen[-1]}"
    if verify or "CERTIFICATE_VERIFY_FAILED" in text:
        why = (verify[0].verify_message if verify else "") or "untrusted"
        if (verify and verify[0].verify_code == 62) or "mismatch" in why:
            return (f"etcd's TLS certificate at {where} is not valid for host {host!r} ({why})",
                    "connect by a name or address the certificate holds; or, a downgrade the "
                    "start-up check warns about, add insecure_skip_tls_verify=true to the "
                    "lock URL")  # fmt: skip
        return (f"etcd's TLS certificate at {where} did not verify ({why})",
                "pass the CA that signed it as cacert=/path/ca.pem in the lock URL (etcdctl's "
                "--cacert)")  # fmt: skip
    low = text.lower()
    if "wrong_version_number" in low or "wrong version number" in low:
        return (f"etcd at {where} does not speak TLS on this port",
                "use etcd:// (plain HTTP), or turn TLS on at the server (--cert-file, "
                "--key-file)")  # fmt: skip
    return (f"etcd at {where} refused the TLS session ({detail}): it may require a client "
            "certificate from its CA (--client-cert-auth)",
            "pass cert=/path/client.pem&key=/path/client.key in the lock URL (etcdctl's --cert "
            "and --key), signed by the CA of etcd's --trusted-ca-file")  # fmt: skip
