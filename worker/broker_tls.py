"""Verified TLS for a rediss:// Celery broker and result backend: broker_use_ssl and its kin."""

from __future__ import annotations

import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from jobfence.config import UnsafeSettings, security
from jobfence.config.security import Downgrade, UrlPosture
from jobfence.config.urls import redact, split_userinfo
from jobfence.locks.backends.redis.url import check_files, url_tls

__all__ = ["BACKEND_SSL", "BROKER_SSL", "ClientTls", "broker_client_tls", "downgrades",
           "fill", "use_ssl"]  # fmt: skip

BROKER_SSL = "broker_use_ssl"
BACKEND_SSL = "redis_backend_use_ssl"
_CONSTANT = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
_NAME = {ssl.CERT_REQUIRED: "required", ssl.CERT_OPTIONAL: "optional", ssl.CERT_NONE: "none"}
_FALSE = frozenset({"false", "0", "no", "off"})
FIX = (
    "leave broker_use_ssl / redis_backend_use_ssl unset (jobfence fills in the verified "
    "options from the rediss:// URL: ssl_ca_certs=, ssl_certfile=, ssl_keyfile=) or give them "
    "ssl_cert_reqs=ssl.CERT_REQUIRED with the host-name check left on"
)


def _get(conf: Any, key: str) -> Any:
    """A Celery setting of `conf` (a Celery configuration, or any object with the attribute)."""
    return getattr(conf, key, None)


def _is_rediss(url: str | None) -> bool:
    return bool(url) and urlsplit(str(url)).scheme.lower() == "rediss"


def _ssl_query(url: str) -> dict[str, str]:
    query = split_userinfo(url)[1].partition("?")[2].partition("#")[0]
    return {k.lower(): v for k, v in parse_qsl(query, keep_blank_values=True)
            if k.lower().startswith("ssl_")}  # fmt: skip


def use_ssl(url: str | None, variable: str) -> dict[str, Any] | None:
    """Celery's broker_use_ssl / redis_backend_use_ssl for a rediss:// `url`: the URL's CA and
    client files, the certificate required and the host name checked (unless the URL itself
    turns a check off: a downgrade the start-up check judges); None for any other URL. An
    option that cannot work (an unreadable file, a bad value) raises UnsafeSettings."""
    if url is None or not _is_rediss(url):
        return None
    tls = url_tls(url, variable)
    check_files(tls, variable)
    options: dict[str, Any] = {
        "ssl_cert_reqs": _CONSTANT[tls.cert_reqs],
        "ssl_check_hostname": tls.check_hostname,
    }
    for name, value in (("ssl_ca_certs", tls.ca_certs), ("ssl_certfile", tls.certfile),
                        ("ssl_keyfile", tls.keyfile)):  # fmt: skip
        if value:
            options[name] = value
    return options


def fill(conf: Any) -> list[str]:
    """Set broker_use_ssl and redis_backend_use_ssl to `use_ssl` of a rediss:// broker and
    result backend where the app leaves them unset (kombu's Redis transport otherwise
    connects with no certificate check); returns the settings filled in."""
    filled = []
    for url_key, ssl_key in (("broker_url", BROKER_SSL), ("result_backend", BACKEND_SSL)):
        url = _get(conf, url_key)
        if not isinstance(url, str) or not _is_rediss(url) or conf.value_set_for(ssl_key):
            continue
        try:
            options = use_ssl(url, url_key)
        except UnsafeSettings:  # never while Celery loads its configuration (an import):
            continue  # the start-up checks refuse the URL, naming the option
        if options is not None:
            conf[ssl_key] = options
            filled.append(ssl_key)
    return filled


@dataclass(frozen=True)
class ClientTls:
    """The TLS a Celery client of a rediss:// URL will use: redis-py's ssl_ options, and
    where they come from (the URL's query, the *_use_ssl setting, kombu's default)."""

    options: Mapping[str, Any]
    source: str
    plain: bool = False  # the client speaks plain TCP although the URL says rediss://

    @property
    def cert_reqs(self) -> str:
        value = self.options.get("ssl_cert_reqs", "required")  # redis-py's default
        if isinstance(value, int):
            return _NAME.get(ssl.VerifyMode(value), "none")
        return str(value).lower().removeprefix("cert_")

    @property
    def check_hostname(self) -> bool:
        value = self.options.get("ssl_check_hostname", True)  # redis-py's default (6+)
        if isinstance(value, str):
            return value.strip().lower() not in _FALSE
        return bool(value)

    def unverified(self) -> str | None:
        """Why the server is not verified (None: certificate and host name are checked)."""
        if self.plain:
            return f"plain TCP ({self.source})"
        if self.cert_reqs != "required":
            return f"ssl_cert_reqs={self.cert_reqs} from {self.source}"
        if not self.check_hostname:
            return f"ssl_check_hostname=false from {self.source}"
        return None


def broker_client_tls(conf: Any) -> ClientTls | None:
    """How kombu's Redis transport will speak TLS to a rediss:// broker_url (None: no such
    broker): the URL's ssl_ options replace broker_use_ssl whole; without either, kombu
    turns the certificate check off; a broker_use_ssl that is not a dict leaves it plain."""
    url = _get(conf, "broker_url")
    if not isinstance(url, str) or not _is_rediss(url):
        return None
    if _ssl_query(url):
        tls = url_tls(url, "broker_url")
        return ClientTls({"ssl_cert_reqs": tls.cert_reqs, "ssl_check_hostname": tls.check_hostname,
                          **({"ssl_ca_certs": tls.ca_certs} if tls.ca_certs else {}),
                          **({"ssl_certfile": tls.certfile, "ssl_keyfile": tls.keyfile}
                             if tls.certfile else {})},
                         "the broker URL's ssl_ options")  # fmt: skip
    given = _get(conf, BROKER_SSL)
    if isinstance(given, Mapping):
        return ClientTls(dict(given), BROKER_SSL)
    if given:
        return ClientTls({}, f"{BROKER_SSL}={given!r}, not a dict of ssl_ options", plain=True)
    return ClientTls({"ssl_cert_reqs": ssl.CERT_NONE}, f"no {BROKER_SSL} (kombu's default)")


def backend_client_tls(conf: Any) -> ClientTls | None:
    """How Celery's Redis result backend will speak TLS to a rediss:// result_backend (None:
    no such backend): redis_backend_use_ssl, each ssl_ option of the URL's query over it."""
    url = _get(conf, "result_backend")
    if not isinstance(url, str) or not _is_rediss(url):
        return None
    given = _get(conf, BACKEND_SSL)
    options = dict(given) if isinstance(given, Mapping) else {}
    query = _ssl_query(url)
    options.update(query)
    source = BACKEND_SSL if isinstance(given, Mapping) else f"no {BACKEND_SSL}"
    if query:
        source += " and the result backend URL's ssl_ options"
    return ClientTls(options, source)


def _variable(url: str, settings: Any, fallback: str) -> str:
    """The JOBFENCE_* variable that set `url`, else the Celery setting's name."""
    for variable, value in settings.server_urls().items():
        if value == url:
            return str(variable)
    return fallback


def downgrades(conf: Any, settings: Any) -> Iterator[Downgrade]:
    """An unverified rediss:// broker or result backend, judged by the options its client
    will really use (not the URL's text alone), off loopback as every URL is."""
    for key, found in (("broker_url", broker_client_tls(conf)),
                       ("result_backend", backend_client_tls(conf))):  # fmt: skip
        why = found.unverified() if found is not None else None
        if why is None:
            continue
        url = str(_get(conf, key))
        posture = security.url_posture(url, _variable(url, settings, key))
        if posture is None or posture.loopback:
            continue
        what = "Celery broker" if key == "broker_url" else "Celery result backend"
        if found is not None and found.plain and posture.password:
            yield Downgrade("cleartext", posture.variable, f"the {what} {posture.shown} is "
                            f"spoken to in {why}: the password crosses in clear text", FIX)
            continue
        yield Downgrade(
            "unverified-tls", posture.variable,
            f"the {what} {posture.shown} is spoken to with TLS unverified ({why}): anyone "
            "between this host and the server can pose as it and read the password", FIX,
        )


def corrected(posture: UrlPosture, conf: Any) -> UrlPosture:
    """`posture` of the app's broker or result backend URL, its TLS as the client will use it."""
    for key, found in (("broker_url", broker_client_tls(conf)),
                       ("result_backend", backend_client_tls(conf))):  # fmt: skip
        if found is None or redact(str(_get(conf, key))) != posture.shown:
            continue
        why = found.unverified()
        if why is not None and posture.tls == "verified":
            return replace(posture, tls=f"unverified ({why})")
    return posture
