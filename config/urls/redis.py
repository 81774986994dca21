"""Redis-family URL grammar every Redis store shares: one node's URL (redis://, rediss://,
unix://), the TLS options (ssl_...), and the comma list of hosts the multi-node schemes name."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl

from jobfence.config.errors import UnsafeSettings
from jobfence.config.schemes import REDIS_FAMILY, UNIX_SCHEME, backend_schemes
from jobfence.config.urls.check import LOCK_EXAMPLE, check_url
from jobfence.config.urls.redact import host_port, port_problem, redact, split_userinfo

#: TLS spellings of the Redis family's schemes, and the plain scheme of each.
REDIS_TLS_SCHEMES = {row.tls: row.plain for row in map(backend_schemes, REDIS_FAMILY) if row.tls}
#: The TLS options every Redis-family URL takes, named as redis-py's keyword arguments.
REDIS_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
                     "ssl_check_hostname")  # fmt: skip
_CERT_REQS = {"none": "none", "cert_none": "none", "optional": "optional",
              "cert_optional": "optional", "required": "required", "cert_required": "required"}
_BOOLS = {"true": True, "1": True, "yes": True, "on": True,
          "false": False, "0": False, "no": False, "off": False}  # fmt: skip


@dataclass(frozen=True)
class RedisTls:
    """The TLS a Redis-family URL asks for (`on` False: plain TCP). Verification and the
    host-name check are on unless the URL turns them off (ssl_cert_reqs=none or optional,
    ssl_check_hostname=false): jobfence sets them itself, whatever the redis-py version."""

    on: bool = False
    ca_certs: str | None = None  # None: the system's trusted CAs
    certfile: str | None = None  # a client certificate (with keyfile)
    keyfile: str | None = None
    cert_reqs: str = "required"  # required | optional | none
    check_hostname: bool = True

    @property
    def verified(self) -> bool:
        return self.on and self.cert_reqs == "required"

    @property
    def hostname_checked(self) -> bool:
        return self.verified and self.check_hostname

    def query(self) -> dict[str, str]:
        """The options as a URL's query, for one master's rediss:// URL (Redlock)."""
        if not self.on:
            return {}
        out = {"ssl_cert_reqs": self.cert_reqs,
               "ssl_check_hostname": "true" if self.check_hostname else "false"}  # fmt: skip
        for name, value in (("ssl_ca_certs", self.ca_certs), ("ssl_certfile", self.certfile),
                            ("ssl_keyfile", self.keyfile)):  # fmt: skip
            if value:
                out[name] = value
        return out


def redis_tls(url: str, options: dict[str, str], variable: str = "JOBFENCE_LOCK_URL") -> RedisTls:
    """The TLS of a Redis-family URL: its scheme (rediss, rediss+sentinel, rediss+cluster,
    redlocks) turns TLS on, and `options` (its query) may name a CA, a client certificate, or
    turn a check off. The one parsing of these options for every Redis store, sync and async;
    refused, naming the option and the fix, if an option is unknown, has a bad value, or
    asks for TLS on a plain scheme."""
    scheme = url.split("://", 1)[0].lower()
    shown = redact(url)
    given = {k: v for k, v in options.items() if k in REDIS_TLS_OPTIONS}
    if scheme not in REDIS_TLS_SCHEMES:
        _refuse_tls_on_plain(scheme, shown, given, variable)
        return RedisTls()
    reqs, check = _verification(shown, given, variable)
    _refuse_bad_files(shown, given, variable)
    return RedisTls(
        on=True,
        ca_certs=given.get("ssl_ca_certs"),
        certfile=given.get("ssl_certfile"),
        keyfile=given.get("ssl_keyfile"),
        cert_reqs=reqs,
        check_hostname=check,
    )


def _refuse_tls_on_plain(scheme: str, shown: str, given: dict[str, str], variable: str) -> None:
    """ssl_ options on a plain scheme would be ignored: refused, naming the TLS scheme."""
    if given:
        tls = next((s for s, plain in REDIS_TLS_SCHEMES.items() if plain == scheme), "")
        raise UnsafeSettings(
            variable, f"{shown!r} has {next(iter(given))}= but {scheme}:// is plain TCP: "
            "the option would be ignored and nothing encrypted",
            f"use {tls or 'a TLS scheme'}:// for TLS, or drop the ssl_ options",
        )


def _verification(shown: str, given: dict[str, str], variable: str) -> tuple[str, bool]:
    """(ssl_cert_reqs, whether the host name is checked) a TLS URL asks for."""
    reqs = given.get("ssl_cert_reqs", "required").lower()
    if reqs not in _CERT_REQS:
        raise UnsafeSettings(variable, f"{shown!r} has ssl_cert_reqs={reqs!r}",
                             "use ssl_cert_reqs=required (the default), optional or none")
    reqs = _CERT_REQS[reqs]
    raw = given.get("ssl_check_hostname")
    if raw is not None and raw.lower() not in _BOOLS:
        raise UnsafeSettings(variable, f"{shown!r} has ssl_check_hostname={raw!r}",
                             "use ssl_check_hostname=true (the default) or false")
    # A host name cannot be checked on a certificate nobody verified: ssl_cert_reqs=none
    # turns the check off with it (one downgrade, which the start-up check reports).
    check = _BOOLS[raw.lower()] if raw is not None else reqs != "none"
    if check and reqs == "none":
        raise UnsafeSettings(
            variable, f"{shown!r} has ssl_check_hostname=true with ssl_cert_reqs=none: a host "
            "name cannot be checked on a certificate that is not verified",
            "drop ssl_cert_reqs=none (verification is the default)",
        )
    return reqs, check


def _refuse_bad_files(shown: str, given: dict[str, str], variable: str) -> None:
    """The CA, certificate and key options: each a path, and no key without its certificate."""
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in given and not given[name]:
            raise UnsafeSettings(variable, f"{shown!r} has an empty {name}=",
                                 f"give {name} a file path, or drop it")  # fmt: skip
    if "ssl_keyfile" in given and "ssl_certfile" not in given:
        raise UnsafeSettings(
            variable, f"{shown!r} has ssl_keyfile= without ssl_certfile=",
            "give the client certificate as ssl_certfile=/path/client.crt with its key",
        )


def check_redis_url(url: str, variable: str) -> None:
    """redis://, rediss:// (a host, a numeric db) or unix:// (a socket path)."""
    check_url(url, variable=variable, schemes=None, example=LOCK_EXAMPLE, what="lock backend")
    fix = f"set {variable} to a URL such as {LOCK_EXAMPLE}"
    scheme, rest = url.split("://", 1)
    if scheme.lower() != UNIX_SCHEME:  # redis:// or rediss:// (the backend's only others)
        if not host_port(url)[0].strip("[]"):
            raise UnsafeSettings(variable, f"{redact(url)!r} names no host", fix)
        path = rest.split("?", 1)[0].split("#", 1)[0]
        db = path.partition("/")[2]
        if db and not db.isdigit():
            raise UnsafeSettings(
                variable, f"{redact(url)!r} has database {db!r}, which is not a number", fix
            )
    elif not rest.split("?", 1)[0]:
        raise UnsafeSettings(
            variable, f"{redact(url)!r} names no socket path",
            f"set {variable} to a URL such as unix:///run/redis/redis.sock?db=0",
        )


def multi_host(
    url: str, scheme: str, variable: str, fix: str, options: tuple[str, ...] = ()
) -> tuple[str, str, str, dict[str, str]]:
    """(shown, userinfo, rest, query options) of a `scheme://[user:password@]host:port[,...]`
    URL (or its TLS spelling, REDIS_TLS_SCHEMES), refused with one line naming `variable` if
    the scheme, credentials or options are wrong; `options`: the query options it takes."""
    shown = redact(url)
    spellings = [scheme, *(s for s, plain in REDIS_TLS_SCHEMES.items() if plain == scheme)]
    if not any(url.lower().startswith(f"{s}://") for s in spellings):
        raise UnsafeSettings(variable, f"{shown!r} is not a {scheme}:// URL", fix)
    userinfo, rest = split_userinfo(url)
    if any(c in userinfo for c in "/#?"):
        raise UnsafeSettings(
            variable,
            f"{shown!r} has '/', '?' or '#' in its user name or password",
            "percent-encode them in the URL (/ as %2F, ? as %3F, # as %23, @ as %40)",
        )
    if "#" in rest:
        raise UnsafeSettings(variable, f"{shown!r} has a fragment ('#'), which {scheme}:// "
                             "does not take", "percent-encode '#' as %23")  # fmt: skip
    rest, _, query = rest.partition("?")
    found: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in options:
            raise UnsafeSettings(
                variable, f"{shown!r} has option {name!r}, which {scheme}:// does not take",
                f"{fix}, with only {', '.join(options)} as query options" if options else fix,
            )
        found[name] = value
    return shown, userinfo, rest, found


def host_list(
    hosts: str, what: str, default_port: int, shown: str, variable: str, fix: str
) -> list[tuple[str, int]]:
    """Each `host[:port]` of a comma list, as (host as written, port)."""
    found: list[tuple[str, int]] = []
    for entry in hosts.split(","):
        entry = entry.strip()
        if not entry:
            raise UnsafeSettings(
                variable, f"{shown!r} has an empty {what} in its list (it names no host)", fix
            )
        probe = f"{backend_schemes('redis').plain}://{entry}"  # parsed as a one-host URL
        host, port = host_port(probe)
        problem = port_problem(probe)
        if problem or not host.strip("[]"):
            raise UnsafeSettings(
                variable, f"{shown!r}: {what} {entry!r} {problem or 'names no host'}", fix
            )
        found.append((host, int(port or default_port)))
    return found
