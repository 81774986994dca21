"""TLS towards MySQL/MariaDB: the URL's TLS options read strictly, and their SSLContext.

With them a connection class that never sends the login to a server offering no TLS when TLS
was asked for, and the SQLAlchemy hook reading the effects database's options the same way.
"""

from __future__ import annotations

import ssl
from typing import Any

import pymysql  # type: ignore[import-untyped]  # PyMySQL ships no type hints
from pymysql.constants import CLIENT  # type: ignore[import-untyped]

# Bound from sys.modules["pymysql.err"] (see backend.py): a later MySQLdb shim replaces the
# `pymysql.err` attribute, not the classes connections raise.
from pymysql.err import OperationalError as PyMySQLOperationalError  # type: ignore[import-untyped]

from jobfence.locks.backend import Security
from jobfence.locks.backends.common import flag_value
from jobfence.locks.errors import LockError

SSL_MODES = ("VERIFY_IDENTITY", "VERIFY_CA", "REQUIRED", "DISABLED")
TLS_FILES = ("ssl_ca", "ssl_cert", "ssl_key")
LOCK_URL = "the MySQL lock URL"  # where the options come from, as refusals name it


class TlsNotOffered(PyMySQLOperationalError):  # type: ignore[misc]  # untyped base
    """TLS was asked for and the server's greeting offers none: refused before the login."""


class TlsFirstConnection(pymysql.connections.Connection):  # type: ignore[misc]  # untyped base
    """A PyMySQL connection that refuses, before sending the login, a server offering no
    TLS when its arguments ask for TLS.

    PyMySQL 1.1.x carried on in clear text there and answered the server's switch to
    `mysql_clear_password` with the password; 1.2.0+ refuses too. Checked here so that no
    PyMySQL version and no man in the middle stripping the SSL flag can get the login.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._tls_asked = asks_tls(kwargs)
        super().__init__(**kwargs)

    def _request_authentication(self) -> None:
        # `client_flag` has CLIENT.SSL whenever PyMySQL itself was asked for TLS (every
        # version); PREFERRED (no TLS option) has not, and may fall back as the URL allows.
        asked = self._tls_asked or bool(self.client_flag & CLIENT.SSL)
        if asked and not self.server_capabilities & CLIENT.SSL:
            raise TlsNotOffered(
                2026,
                f"the MySQL server at {self.host}:{self.port} offers no TLS (its greeting "
                "lacks the SSL capability) though the URL asks for it (ssl_mode, ssl_ca, "
                "ssl_cert or ssl_verify_*): refused before sending the login, no password "
                "was sent",
            )
        super()._request_authentication()


def asks_tls(kwargs: dict[str, Any]) -> bool:
    """Whether PyMySQL arguments ask for TLS (as every PyMySQL reads them)."""
    if kwargs.get("ssl_disabled"):
        return False
    names = ("ssl", "ssl_ca", "ssl_cert", "ssl_key", "ssl_verify_cert", "ssl_verify_identity")
    return any(kwargs.get(name) for name in names)


def flag(name: str, value: str, where: str = LOCK_URL) -> bool:
    """Option `name`'s true or false; LockError naming it otherwise."""
    if (parsed := flag_value(value)) is not None:
        return parsed
    raise LockError(f"option {name}={value!r} in {where} is not true or false")


def tls_options(options: dict[str, str], where: str = LOCK_URL) -> dict[str, Any]:
    """PyMySQL's TLS arguments, every one explicit, from the URL's TLS options.

    Any of `ssl_ca`, `ssl_cert`, `ssl_key`, `ssl_verify_cert=true`, `ssl_verify_identity=true`
    or `ssl_mode` (but DISABLED) asks for TLS, and TLS means VERIFY_IDENTITY: the chain
    (against `ssl_ca`, else the system's CAs) and the host name. Less is a downgrade spelled
    out: `ssl_verify_identity=false` / `ssl_mode=VERIFY_CA` (chain only), `ssl_verify_cert=false`
    / `ssl_mode=REQUIRED` (encryption only). No option: no TLS asked for.
    """
    files = {name: options[name] for name in TLS_FILES if options.get(name)}
    for name in TLS_FILES:
        if name in options and not options[name]:
            raise LockError(f"option {name}= in {where} is empty: give a file path")
    cert = flag("ssl_verify_cert", options["ssl_verify_cert"], where) \
        if "ssl_verify_cert" in options else None  # fmt: skip
    identity = flag("ssl_verify_identity", options["ssl_verify_identity"], where) \
        if "ssl_verify_identity" in options else None  # fmt: skip
    if "ssl_mode" in options:
        mode = _ssl_mode(options["ssl_mode"], files, explicit=(cert, identity), where=where)
        if mode == "DISABLED":
            return {"ssl_disabled": True}
        cert, identity = mode != "REQUIRED", mode == "VERIFY_IDENTITY"
    elif not files and not cert and not identity:
        return {}  # no TLS asked for (ssl_verify_cert=false alone turns nothing on)
    if identity and cert is False:
        raise LockError(
            f"{where} gives ssl_verify_identity=true with ssl_verify_cert=false: a host "
            "name is checked only on a verified certificate; drop ssl_verify_cert=false"
        )
    if "ssl_key" in files and "ssl_cert" not in files:
        raise LockError(
            f"{where} gives ssl_key without ssl_cert: add ssl_cert=/path/client.pem"
        )
    cert = cert is not False
    identity = cert if identity is None else identity
    return {**files, "ssl_verify_cert": cert, "ssl_verify_identity": identity}


def _ssl_mode(
    value: str, files: dict[str, str], *, explicit: tuple[bool | None, bool | None], where: str
) -> str:
    """`ssl_mode`'s value, upper case; LockError for an unknown mode, for a mode beside the
    verify flags (`explicit`), and for DISABLED beside TLS files."""
    mode = value.strip().upper().replace("-", "_")
    if mode not in SSL_MODES:
        raise LockError(
            f"ssl_mode={value!r} in {where} is not one of "
            f"{', '.join(SSL_MODES)}; use ssl_mode=VERIFY_IDENTITY (PREFERRED, which may "
            "fall back to plain text, is not offered)"
        )
    if any(given is not None for given in explicit):
        raise LockError(
            f"{where} gives both ssl_mode and ssl_verify_cert/ssl_verify_identity; "
            "spell the TLS mode once, e.g. ssl_mode=VERIFY_IDENTITY"
        )
    if mode == "DISABLED" and files:
        raise LockError(
            f"{where} gives ssl_mode=DISABLED with {', '.join(files)}; "
            "drop one: TLS files with TLS disabled are never read"
        )
    return mode


def tls_context(args: dict[str, Any], where: str = LOCK_URL) -> ssl.SSLContext | None:
    """The SSLContext for `parse_url`'s TLS arguments (None: no TLS asked for).

    Built here rather than by PyMySQL, which checks no host name for `ssl_ca` alone nor
    without a CA file, and (before 1.1.1) no certificate at all for `ssl_ca` alone."""
    if not tls_asked(args):
        return None
    try:
        ctx = ssl.create_default_context(cafile=args.get("ssl_ca"))
    except (OSError, ssl.SSLError) as exc:
        raise LockError(
            f"ssl_ca={args.get('ssl_ca')!r} in {where} cannot be loaded ({exc}); "
            "give a readable PEM file of the CA that signed the server's certificate"
        ) from exc
    # As PyMySQL does: MySQL's auto-generated certificates fail Python 3.13's strict checks.
    ctx.verify_flags &= ~getattr(ssl, "VERIFY_X509_STRICT", 0)
    ctx.check_hostname = bool(args.get("ssl_verify_identity"))  # before verify_mode
    ctx.verify_mode = ssl.CERT_REQUIRED if args.get("ssl_verify_cert", True) else ssl.CERT_NONE
    if args.get("ssl_cert"):
        try:
            ctx.load_cert_chain(args["ssl_cert"], keyfile=args.get("ssl_key"))
        except (OSError, ssl.SSLError) as exc:
            raise LockError(
                f"ssl_cert={args['ssl_cert']!r} / ssl_key={args.get('ssl_key')!r} in "
                f"{where} cannot be loaded ({exc}); give the client certificate and its "
                "unencrypted key as PEM files"
            ) from exc
    return ctx


def connect_for_sqlalchemy(where: str, **cparams: Any) -> TlsFirstConnection:
    """The PyMySQL connection for a SQLAlchemy `mysql+pymysql://` URL (the effects
    database), its TLS options read as the lock URL's: `ssl_mode` understood, `ssl_ca`
    alone verifying chain and host name, and no login sent to a server offering no TLS.

    `cparams` are SQLAlchemy's, which folds ssl_ca/ssl_cert/ssl_key/ssl_capath/ssl_cipher/
    ssl_check_hostname into an `ssl` dict and passes other query options on as strings."""
    args = dict(cparams)
    folded = dict(args.pop("ssl", None) or {})
    options = {f"ssl_{k}": str(folded.pop(k)) for k in ("ca", "cert", "key") if k in folded}
    if "check_hostname" in folded:
        options["ssl_verify_identity"] = str(folded.pop("check_hostname"))
    for name in ("ssl_mode", "ssl_verify_cert", "ssl_verify_identity"):
        if name in args:
            options[name] = str(args.pop(name))
    capath, cipher = folded.pop("capath", None), folded.pop("cipher", None)
    if folded:
        raise LockError(f"unknown TLS option(s) {', '.join(sorted(folded))} in {where}")
    if (capath or cipher) and not any(k.startswith("ssl_") for k in options):
        options["ssl_verify_cert"] = "true"  # as PyMySQL: any TLS option asks for TLS
    if "ssl_disabled" in args:
        args["ssl_disabled"] = flag("ssl_disabled", str(args["ssl_disabled"]), where)
    tls = tls_options(options, where)
    if tls.pop("ssl_disabled", False):
        args["ssl_disabled"] = True
    ctx = tls_context(tls, where)
    if ctx is not None:
        if args.get("ssl_disabled"):
            raise LockError(f"{where} gives ssl_disabled=true with TLS options: drop one")
        if capath:
            ctx.load_verify_locations(capath=str(capath))
        if cipher:
            ctx.set_ciphers(str(cipher))
        args["ssl"] = ctx
    return TlsFirstConnection(**args)


def tls_asked(args: dict[str, Any]) -> bool:
    """Whether `tls_options`' arguments turn TLS on: it spells out both verify flags then."""
    return any(name in args for name in ("ssl_verify_cert", "ssl_verify_identity", *TLS_FILES))


def security_of(args: dict[str, Any]) -> Security:
    """TLS and authentication as connect arguments `args` ask for them."""
    tls = tls_asked(args)
    return Security(
        tls=tls,
        verified=tls and bool(args.get("ssl_verify_cert", True)),
        hostname_checked=tls and bool(args.get("ssl_verify_identity")),
        auth=bool(args.get("password") or args.get("ssl_cert")),
    )
