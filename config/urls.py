"""URL checks and redaction for settings: one-line errors with an example, no password shown."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlencode

from jobfence.config.errors import UnsafeSettings
from jobfence.config.schemes import LOCK_SCHEMES, REDIS_FAMILY, UNIX_SCHEME, backend_schemes

# Query parameters that carry a credential (redis-py and kombu pass unknown ones through).
#: A lock URL check: raises UnsafeSettings naming the variable (its second argument).
UrlCheck = Callable[[str, str], object]

_SECRET_QUERY = re.compile(r"(pass(word|wd)?|pwd|secret|token|auth|credential|key)", re.I)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_REDACTED = "***"


def redact(url: str) -> str:
    """`url` without its password (userinfo and credential query parameters), fit for a log line.

    The one redaction of the package: every message, log line and `check` output that shows a
    URL shows it through here. Works on text that is not a valid URL too (a bad port, a
    password holding `/`, `?` or `@`), since that is exactly what error messages show:
    everything between `://` and the last `@` is taken for the userinfo, so a password with an
    unencoded `?` is hidden too (an `@` in a query value then hides a little more than needed,
    never less). Any query parameter whose name holds pass, secret, token, key, auth or
    credential has its value replaced.
    """
    if not url:
        return url
    match = _SCHEME.match(url)
    head, rest = (url[: match.end()], url[match.end() :]) if match else ("", url)
    at = _userinfo_end(rest)
    if at >= 0:
        userinfo, rest = rest[:at], rest[at + 1 :]
        user, colon, _ = userinfo.partition(":")
        # With no ':' the userinfo is a user name, or (some services) a bare token: hide a
        # bare token too, unless it looks like a plain user name.
        shown = f"{user}:{_REDACTED}" if colon else (user if user.isidentifier() else _REDACTED)
        rest = f"{shown}@{rest}"
    q = rest.find("?")
    if q >= 0:
        frag = rest.find("#", q)
        query = rest[q + 1 : frag if frag >= 0 else len(rest)]
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_QUERY.search(k) for k, _ in pairs):
            clean = [(k, _REDACTED if _SECRET_QUERY.search(k) else v) for k, v in pairs]
            tail = rest[frag:] if frag >= 0 else ""
            rest = rest[: q + 1] + urlencode(clean, safe="*/:") + tail
    return head + rest


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]+)(:[0-9]+)?$")


def _plain_authority(text: str) -> bool:
    """Whether `text` (a URL after its scheme, before its '?') is hosts and a path with no
    userinfo: then an '@' after the '?' is in the query, not the end of a password."""
    authority, slash, _ = text.partition("/")
    return bool(slash) and all(_HOST_PORT.match(part) for part in authority.split(","))


def _userinfo_end(rest: str) -> int:
    """Index of the '@' that ends the userinfo in `rest` (a URL after `://`), or -1: the last
    '@', unless the text before the first '?' is plainly hosts and a path (then an '@' after
    it is in a query value)."""
    at = rest.rfind("@")
    q = rest.find("?")
    if 0 <= q < at and _plain_authority(rest[:q]):
        at = rest.rfind("@", 0, q)
    return at


def _split_userinfo(url: str) -> tuple[str, str]:
    """(userinfo, the rest after it) of a URL with a scheme, the way `redact` splits it."""
    rest = url.split("://", 1)[1]
    at = _userinfo_end(rest)
    return (rest[:at], rest[at + 1 :]) if at >= 0 else ("", rest)


def _authority(url: str) -> str:
    rest = _split_userinfo(url)[1]
    for sep in "/?#":
        rest = rest.split(sep, 1)[0]
    return rest


def _host_port(url: str) -> tuple[str, str]:
    """(host, port text) of `url`'s authority; either may be empty."""
    hostport = _authority(url)
    if hostport.startswith("["):  # [::1]:6379
        close = hostport.find("]")
        return hostport[: close + 1], hostport[close + 1 :].removeprefix(":")
    host, colon, port = hostport.rpartition(":")
    return (host, port) if colon else (hostport, "")


def _port_problem(url: str) -> str | None:
    """Why the port of `url` is unusable, or None (also None when it has no port)."""
    host, port = _host_port(url)
    if host.startswith("[") and not host.endswith("]"):
        return "has an unclosed '[' in its host"
    if not port:
        return None
    if not port.isdigit():
        return f"has port {port!r}, which is not a number"
    if not 0 < int(port) < 65536:
        return f"has port {port}, outside 1-65535"
    return None


def check_url(
    url: str, *, variable: str, schemes: tuple[str, ...] | None, example: str, what: str
) -> None:
    """Raise UnsafeSettings (one line: variable, problem, an example) if `url` is unusable.

    `schemes` None accepts any scheme (broker and database URLs: kombu and SQLAlchemy
    have many); `what` names the server in the message.
    """
    fix = f"set {variable} to a URL such as {example}"
    shown = redact(url)
    if not _SCHEME.match(url):
        raise UnsafeSettings(variable, f"{shown!r} has no scheme (scheme://host:port)", fix)
    scheme = url.split("://", 1)[0].lower()
    if schemes is not None and scheme not in schemes:
        raise UnsafeSettings(
            variable,
            f"scheme {scheme!r} is not a {what} jobfence supports "
            f"(use {', '.join(s + '://' for s in schemes)})",
            fix,
        )
    if any(c in _split_userinfo(url)[0] for c in "/#?"):
        raise UnsafeSettings(
            variable,
            f"{shown!r} has '/', '?' or '#' in its user name or password, which clients read "
            "as the end of the host part",
            "percent-encode them in the URL (/ as %2F, ? as %3F, # as %23, @ as %40)",
        )
    port = _port_problem(url)
    if port:
        raise UnsafeSettings(variable, f"{shown!r} {port}", fix)


LOCK_EXAMPLE = "redis://127.0.0.1:6379/0 (TLS: rediss://host:6380/0)"


REDLOCK_EXAMPLE = "redlock://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379"


def _multi_host(
    url: str, scheme: str, variable: str, fix: str, options: tuple[str, ...] = ()
) -> tuple[str, str, str, dict[str, str]]:
    """(shown, userinfo, rest, query options) of a `scheme://[user:password@]host:port[,...]`
    URL (or its TLS spelling, REDIS_TLS_SCHEMES), refused with one line naming `variable` if
    the scheme, credentials or options are wrong; `options`: the query options it takes."""
    shown = redact(url)
    spellings = [scheme, *(s for s, plain in REDIS_TLS_SCHEMES.items() if plain == scheme)]
    if not any(url.lower().startswith(f"{s}://") for s in spellings):
        raise UnsafeSettings(variable, f"{shown!r} is not a {scheme}:// URL", fix)
    userinfo, rest = _split_userinfo(url)
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
    on = scheme in REDIS_TLS_SCHEMES
    if not on:
        if given:
            tls = next((s for s, plain in REDIS_TLS_SCHEMES.items() if plain == scheme), "")
            raise UnsafeSettings(
                variable, f"{shown!r} has {next(iter(given))}= but {scheme}:// is plain TCP: "
                "the option would be ignored and nothing encrypted",
                f"use {tls or 'a TLS scheme'}:// for TLS, or drop the ssl_ options",
            )
        return RedisTls()
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
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in given and not given[name]:
            raise UnsafeSettings(variable, f"{shown!r} has an empty {name}=",
                                 f"give {name} a file path, or drop it")  # fmt: skip
    if "ssl_keyfile" in given and "ssl_certfile" not in given:
        raise UnsafeSettings(
            variable, f"{shown!r} has ssl_keyfile= without ssl_certfile=",
            "give the client certificate as ssl_certfile=/path/client.crt with its key",
        )
    return RedisTls(
        on=True,
        ca_certs=given.get("ssl_ca_certs"),
        certfile=given.get("ssl_certfile"),
        keyfile=given.get("ssl_keyfile"),
        cert_reqs=reqs,
        check_hostname=check,
    )


def _host_list(
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
        host, port = _host_port(probe)
        problem = _port_problem(probe)
        if problem or not host.strip("[]"):
            raise UnsafeSettings(
                variable, f"{shown!r}: {what} {entry!r} {problem or 'names no host'}", fix
            )
        found.append((host, int(port or default_port)))
    return found


def redlock_masters(url: str, variable: str = "JOBFENCE_LOCK_URL") -> list[str]:
    """The redis:// URL of each master a redlock:// URL names, in its order (rediss:// with
    the TLS options, for redlocks://).

    `redlock[s]://[user:password@]host:port,host:port,host:port[,...][/db][?ssl_...]`: an
    odd number of
    at least three distinct masters, so a majority outlives the loss of any minority (an
    even count tolerates no more failures than the odd count below it, and splits votes).
    The user, password, db and TLS options apply to every master (masters with passwords
    of their own: RedlockBackend takes a list of redis:// or rediss:// URLs).
    """
    fix = f"set {variable} to a URL such as {REDLOCK_EXAMPLE}"
    scheme = backend_schemes("redlock").plain
    shown, userinfo, rest, options = _multi_host(url, scheme, variable, fix, REDIS_TLS_OPTIONS)
    tls = redis_tls(url, options, variable)
    hosts, _, tail = rest.partition("/")
    db = tail.strip("/")
    if db and not db.isdigit():
        raise UnsafeSettings(variable, f"{shown!r} has database {db!r}, which is not a number", fix)
    masters = [f"{h}:{p}" for h, p in _host_list(hosts, "master", 6379, shown, variable, fix)]
    duplicates = sorted({m for m in masters if masters.count(m) > 1})
    if duplicates:
        raise UnsafeSettings(
            variable,
            f"{shown!r} names master {duplicates[0]} more than once: one server would cast "
            "several votes of the majority",
            "list each master once",
        )
    if len(masters) < 3 or len(masters) % 2 == 0:
        raise UnsafeSettings(
            variable,
            f"{shown!r} names {len(masters)} master(s); Redlock needs an odd number, at least "
            "3 (3 survive the loss of one, 5 of two; an even count survives no more than the "
            "odd count below it)",
            fix,
        )
    auth = f"{userinfo}@" if userinfo else ""
    query = f"?{urlencode(tls.query(), safe='/', quote_via=quote)}" if tls.on else ""
    redis = backend_schemes("redis")  # each master is a one-node Redis URL
    each = (redis.tls or redis.plain) if tls.on else redis.plain
    return [f"{each}://{auth}{m}/{db or 0}{query}" for m in masters]


CLUSTER_EXAMPLE = "redis+cluster://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379"


@dataclass(frozen=True)
class ClusterTarget:
    """What a redis+cluster:// URL names: seed nodes, the credentials and TLS of every node."""

    nodes: list[tuple[str, int]]
    username: str | None
    password: str | None = field(repr=False)
    tls: RedisTls = field(default_factory=RedisTls)


def cluster_target(url: str, variable: str = "JOBFENCE_LOCK_URL") -> ClusterTarget:
    """Parse `redis+cluster://[user:password@]host:port[,...]` (`rediss+cluster://` and the
    ssl_ options for TLS to every node).

    The seeds are where the client first asks for the cluster's map; any one that answers
    will do, so list several. A cluster has database 0 only: no path but '/' or '/0'.
    """
    fix = f"set {variable} to a URL such as {CLUSTER_EXAMPLE}"
    scheme = backend_schemes("redis-cluster").plain
    shown, userinfo, rest, options = _multi_host(url, scheme, variable, fix, REDIS_TLS_OPTIONS)
    tls = redis_tls(url, options, variable)
    hosts, _, tail = rest.partition("/")
    if tail.strip("/") not in ("", "0"):
        raise UnsafeSettings(
            variable,
            f"{shown!r} names database {tail.strip('/')!r}: a Redis Cluster has database 0 only",
            fix,
        )
    nodes = [(h.strip("[]"), p) for h, p in _host_list(hosts, "node", 6379, shown, variable, fix)]
    user, colon, password = userinfo.partition(":")
    return ClusterTarget(
        list(dict.fromkeys(nodes)), unquote(user) or None, unquote(password) if colon else None,
        tls,
    )


def cluster_nodes(
    url: str, variable: str = "JOBFENCE_LOCK_URL"
) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(seed nodes, user, password) of a redis+cluster:// URL (`cluster_target`)."""
    target = cluster_target(url, variable)
    return target.nodes, target.username, target.password


SENTINEL_EXAMPLE = "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/mymaster/0"


@dataclass(frozen=True)
class SentinelTarget:
    """What a redis+sentinel:// URL names: the sentinels, the master's name, its database,
    the credentials of the master (and its replicas), the sentinels' own credentials
    (`sentinel_username`, `sentinel_password`: none unless given) and the TLS of both."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None = field(repr=False)
    tls: RedisTls = field(default_factory=RedisTls)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


#: The options of a redis+sentinel:// URL: TLS, and the sentinels' own credentials.
SENTINEL_OPTIONS = (*REDIS_TLS_OPTIONS, "sentinel_username", "sentinel_password")


def sentinel_target(url: str, variable: str = "JOBFENCE_LOCK_URL") -> SentinelTarget:
    """Parse `redis+sentinel://[user:password@]host:port[,host:port...]/<master-name>[/db]`
    (`rediss+sentinel://` for TLS to the sentinels and the master, with the ssl_ options;
    `?sentinel_password=` for sentinels that ask for one).

    Each host is a sentinel (port 26379 if left out), the path names the master the
    sentinels monitor (`sentinel monitor <master-name> ...`) and optionally its database.
    """
    fix = f"set {variable} to a URL such as {SENTINEL_EXAMPLE}"
    scheme = backend_schemes("redis-sentinel").plain
    shown, userinfo, rest, options = _multi_host(url, scheme, variable, fix, SENTINEL_OPTIONS)
    tls = redis_tls(url, options, variable)
    if "sentinel_username" in options and not options.get("sentinel_password"):
        raise UnsafeSettings(
            variable, f"{shown!r} has sentinel_username= without sentinel_password=",
            "give the sentinels' password too: ?sentinel_username=u&sentinel_password=p",
        )
    hosts, _, path = rest.partition("/")
    sentinels = [
        (h.strip("[]"), p) for h, p in _host_list(hosts, "sentinel", 26379, shown, variable, fix)
    ]
    if len(set(sentinels)) != len(sentinels):
        raise UnsafeSettings(variable, f"{shown!r} names a sentinel more than once",
                             "list each sentinel once")  # fmt: skip
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise UnsafeSettings(
            variable,
            f"{shown!r} names no master: the path must be the name the sentinels monitor "
            "it by (sentinel monitor <name> ...)",
            fix,
        )
    if db and not db.isdigit():
        raise UnsafeSettings(
            variable, f"{shown!r} has database {db!r}, which is not a number (or a '/' in the "
            "master's name)", fix,
        )
    user, colon, password = userinfo.partition(":")
    return SentinelTarget(
        sentinels=tuple(sentinels),
        service=unquote(service),
        db=int(db or 0),
        username=unquote(user) or None,
        password=unquote(password) if colon else None,
        tls=tls,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
    )


def has_scheme(url: str) -> bool:
    return bool(_SCHEME.match(url))


def check_lock_url(url: str, variable: str) -> None:
    """The lock URL: a scheme a registered backend takes, then that backend's URL checks."""
    check = _LOCK_URL_CHECKS.get(url.split("://", 1)[0].lower()) if has_scheme(url) else None
    if check is None:  # refused here: no scheme, or one no backend takes
        check_url(url, variable=variable, schemes=tuple(_LOCK_URL_CHECKS), example=LOCK_EXAMPLE,
                  what="lock backend")  # fmt: skip
        return
    check(url, variable)


def accept_lock_scheme(scheme: str, check: UrlCheck) -> None:
    """Take lock URLs of `scheme` (lower case), checked by `check` (the registry's register)."""
    _LOCK_URL_CHECKS[scheme] = check


def forget_lock_scheme(scheme: str) -> None:
    """Refuse lock URLs of `scheme` again (the registry's unregister)."""
    _LOCK_URL_CHECKS.pop(scheme, None)


def check_one_host(url: str, variable: str) -> None:
    """The lock URL checks of a backend with none of its own: a host, a numeric port, no '/'
    or '#' in the password."""
    check_url(url, variable=variable, schemes=None, example=LOCK_EXAMPLE, what="lock backend")


def check_redis_url(url: str, variable: str) -> None:
    """redis://, rediss:// (a host, a numeric db) or unix:// (a socket path)."""
    check_url(url, variable=variable, schemes=None, example=LOCK_EXAMPLE, what="lock backend")
    fix = f"set {variable} to a URL such as {LOCK_EXAMPLE}"
    scheme, rest = url.split("://", 1)
    if scheme.lower() != UNIX_SCHEME:  # redis:// or rediss:// (the backend's only others)
        if not _host_port(url)[0].strip("[]"):
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


def check_mysql_url(url: str, variable: str) -> None:
    """mysql://, mariadb://, mysql+pymysql://: the one-host checks and a database name."""
    check_url(url, variable=variable, schemes=None, example=LOCK_EXAMPLE, what="lock backend")
    if not url.split("://", 1)[1].split("?", 1)[0].partition("/")[2].strip("/"):
        raise UnsafeSettings(
            variable, f"{redact(url)!r} names no database",
            f"set {variable} to a URL such as mysql://user:password@127.0.0.1:3306/jobfence",
        )


# etcdctl's TLS flags as query options, as locks.backends.etcd.TLS_OPTIONS (not imported here)
ETCD_OPTIONS = ("cacert", "cert", "key", "insecure_skip_tls_verify")
_ETCD_USERINFO = "etcds://user:password@10.0.0.1:2379 (percent-encoded)"


def check_etcd_url(url: str, variable: str) -> None:
    """etcd[s]://[user:password@]host:port[,host:port...][?TLS options]: every member a host
    and a numeric port, no path; credentials only as user-info, TLS options only on etcds://."""
    fix = f"set {variable} to a URL such as etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    shown = redact(url)
    scheme = url.split("://", 1)[0].lower()
    userinfo, rest = _split_userinfo(url)
    user, colon, password = userinfo.partition(":")
    if userinfo and (not user or not colon or not password):
        raise UnsafeSettings(
            variable, f"{shown!r} has user-info that is not user:password",
            f"set {variable} to a URL such as {_ETCD_USERINFO}",
        )
    if "#" in rest:
        raise UnsafeSettings(variable, f"{shown!r} has a fragment", fix)
    hosts, _, query = rest.partition("?")
    for name in (pair.partition("=")[0] for pair in query.split("&") if pair):
        if (_SECRET_QUERY.search(name) and name != "key") or name.lower() in ("user", "username"):
            raise UnsafeSettings(
                variable, f"{shown!r} has option {name!r}: etcd credentials go in the "
                "user-info, never the query", f"set {variable} to a URL such as {_ETCD_USERINFO}",
            )
        if name not in ETCD_OPTIONS:
            raise UnsafeSettings(
                variable, f"{shown!r} has option {name!r}, which etcd URLs do not take",
                f"use only {', '.join(ETCD_OPTIONS)} (TLS, with etcds://) in the query",
            )
        if scheme != backend_schemes("etcd").tls:
            raise UnsafeSettings(
                variable, f"{shown!r} gives TLS option {name!r} to etcd://, which is plain HTTP",
                f"set {variable} to a URL such as etcds://10.0.0.1:2379?cacert=/path/ca.pem",
            )
    hosts = hosts.rstrip("/")
    if "/" in hosts:
        raise UnsafeSettings(
            variable, f"{shown!r} has a path; etcd URLs name members only", fix
        )
    for member in hosts.split(","):
        host, colon, port = member.strip().rpartition(":")
        if not colon or not host.strip("[]"):
            raise UnsafeSettings(
                variable, f"{shown!r}: member {member.strip()!r} is not host:port", fix
            )
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UnsafeSettings(
                variable, f"{shown!r}: member {member.strip()!r} has port {port!r}, not a "
                "number in 1-65535", fix,
            )


# KazooClient's TLS arguments, as locks.backends.zookeeper.TLS_OPTIONS (kazoo not imported here)
ZOOKEEPER_OPTIONS = ("use_ssl", "ca", "certfile", "keyfile", "verify_certs", "check_hostname")


def check_zookeeper_url(url: str, variable: str) -> None:
    """zookeeper://host:port[,host:port...][/chroot]: every host named, every port a number."""
    fix = f"set {variable} to a URL such as zookeeper://zk1:2181,zk2:2181,zk3:2181/jobfence"
    shown = redact(url)
    userinfo, rest = _split_userinfo(url)
    user, colon, password = userinfo.partition(":")
    if userinfo and (not user or not colon or not password or ":" in unquote(user)):
        raise UnsafeSettings(
            variable, f"{shown!r} has user-info that is not user:password (digest auth)",
            f"set {variable} to a URL such as zookeeper://user:password@zk1:2181/jobfence, "
            "percent-encoded, with no ':' in the user name",
        )
    if "#" in rest:
        raise UnsafeSettings(variable, f"{shown!r} has a fragment", fix)
    rest, _, query = rest.partition("?")
    for name in (pair.partition("=")[0] for pair in query.split("&") if pair):
        if name not in ZOOKEEPER_OPTIONS:
            raise UnsafeSettings(
                variable, f"{shown!r} has option {name!r}, which zookeeper:// does not take",
                f"use only {', '.join(ZOOKEEPER_OPTIONS)} (TLS) in the query",
            )
    hosts, _, chroot = rest.partition("/")
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":")
        if not colon:
            host, port = item, "2181"
        if not host:
            raise UnsafeSettings(variable, f"{shown!r} names no host in {item!r}", fix)
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UnsafeSettings(variable, f"{shown!r} has port {port!r} in {item!r}", fix)
    if chroot and any(p in ("", ".", "..") for p in chroot.rstrip("/").split("/")):
        raise UnsafeSettings(variable, f"{shown!r} has chroot /{chroot}, not a node path", fix)


#: Each backend's own lock URL check, by backend name (config/schemes.py); the others get
#: `check_one_host`. The registry gives each built-in backend its check from here.
LOCK_URL_CHECKS: dict[str, UrlCheck] = {
    "redis": check_redis_url,
    "mysql": check_mysql_url,
    "redlock": redlock_masters,
    "etcd": check_etcd_url,
    "redis-cluster": cluster_target,
    "redis-sentinel": sentinel_target,
    "zookeeper": check_zookeeper_url,
}

# Scheme -> check, for the settings check. Built here from the schemes' table, so checking
# settings needs no import of the locks package (which imports this module: the other way
# would be a cycle); locks/registry.py's register and unregister keep it in step with
# backends added or removed at run time, in registration order.
_LOCK_URL_CHECKS: dict[str, UrlCheck] = {
    scheme.lower(): LOCK_URL_CHECKS.get(name, check_one_host)
    for name, row in LOCK_SCHEMES.items()
    for scheme in row.schemes
}
