"""How settings are refused: field errors without their values, unsafe combinations, downgrades."""

from __future__ import annotations

import ipaddress
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import jobfence.config.security as security
from jobfence.config.errors import InsecureSettings, UnsafeSettings
from jobfence.config.security import is_loopback
from jobfence.config.variables import ENV_PREFIX, URL_FIELDS, variable_name

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic.fields import FieldInfo
    from pydantic_settings import SettingsError

    from jobfence.config.settings import Settings

    #: A settings model's fields by name (`Settings.model_fields`).
    Fields = Mapping[str, FieldInfo]


class InsecureSettingsWarning(UserWarning):
    """A setting that works but exposes data or weakens security."""


#: What workers may accept: JSON, and Celery's `auth` serializer (JSON signed with the
#: app's key; app.setup_security(), docs/reference/security.md).
SAFE_CONTENT = ("json", "application/json", "auth", "application/data")


def refuse_unsafe(s: Settings) -> None:
    """Raise UnsafeSettings naming the variable and the fix for any unsafe combination."""
    p = ENV_PREFIX
    _refuse_bad_lease(s)
    if not s.key_secret.get_secret_value().strip():
        raise UnsafeSettings(
            f"{p}KEY_SECRET",
            "is empty: every deployment would hash task arguments under the same known key",
            f"set {p}KEY_SECRET to a random string of at least {security.MIN_KEY_SECRET} "
            "characters",
        )
    _refuse_hung_calls(s)
    _refuse_short_keeping(s)
    _refuse_bad_redelivery(s)
    refuse_metrics_clash(s)
    _refuse_unsafe_delivery(s)


def _refuse_bad_lease(s: Settings) -> None:
    """The lease: a TTL, a heartbeat well inside it, a wait and a backoff that make sense."""
    p = ENV_PREFIX
    if s.default_ttl <= 0:
        raise UnsafeSettings(
            f"{p}DEFAULT_TTL",
            f"must be > 0, got {s.default_ttl}",
            "set a lease TTL in seconds, e.g. 30",
        )
    if not 0 < s.heartbeat_fraction < 0.5:
        raise UnsafeSettings(
            f"{p}HEARTBEAT_FRACTION",
            f"heartbeat interval {s.heartbeat_interval:g}s must be < TTL/2 "
            f"({s.default_ttl / 2:g}s), got fraction {s.heartbeat_fraction:g}",
            "use a fraction below 0.5; 1/3 is the default",
        )
    if s.acquire_timeout < 0:
        raise UnsafeSettings(
            f"{p}ACQUIRE_TIMEOUT",
            f"must be >= 0, got {s.acquire_timeout}",
            "use 0 to never wait, or a number of seconds",
        )
    if s.backoff_base <= 0 or s.backoff_cap < s.backoff_base:
        raise UnsafeSettings(
            f"{p}BACKOFF_BASE",
            f"need 0 < base <= cap, got base={s.backoff_base} cap={s.backoff_cap}",
            "e.g. JOBFENCE_BACKOFF_BASE=0.005 JOBFENCE_BACKOFF_CAP=0.5",
        )


def _refuse_hung_calls(s: Settings) -> None:
    """A lock-server call (the URL's own timeouts, then JOBFENCE_SOCKET_TIMEOUT) that hangs
    gives up before the lease runs out."""
    p = ENV_PREFIX
    refuse_url_timeouts(s)
    if s.socket_timeout <= 0 or s.socket_timeout >= s.default_ttl - s.heartbeat_interval:
        raise UnsafeSettings(
            f"{p}SOCKET_TIMEOUT",
            f"{s.socket_timeout:g}s must be > 0 and shorter than TTL - heartbeat interval "
            f"({s.default_ttl - s.heartbeat_interval:g}s), or a hung extension outlives the lease",
            "lower JOBFENCE_SOCKET_TIMEOUT or raise JOBFENCE_DEFAULT_TTL",
        )


def _refuse_short_keeping(s: Settings) -> None:
    """Results, decisions and fence counters kept at least as long as they are needed."""
    p = ENV_PREFIX
    if s.result_ttl <= 0:
        raise UnsafeSettings(
            f"{p}RESULT_TTL",
            f"must be > 0, got {s.result_ttl}",
            "keep results at least as long as duplicates may arrive",
        )
    if s.decision_log_size > s.decision_log_total:
        raise UnsafeSettings(
            f"{p}DECISION_LOG_TOTAL",
            f"{s.decision_log_total} is below {p}DECISION_LOG_SIZE ({s.decision_log_size})",
            f"keep {p}DECISION_LOG_TOTAL at least {p}DECISION_LOG_SIZE (default 10000)",
        )
    if s.fence_retention < s.default_ttl:
        raise UnsafeSettings(
            f"{p}FENCE_RETENTION",
            "must be at least the lease TTL",
            "keep fence counters for days, e.g. 2592000",
        )


def _refuse_bad_redelivery(s: Settings) -> None:
    """Redeliveries of a job whose fate is unknown: a count and a first countdown."""
    p = ENV_PREFIX
    if s.redelivery_limit < 0:
        raise UnsafeSettings(
            f"{p}REDELIVERY_LIMIT",
            f"must be >= 0, got {s.redelivery_limit}",
            "use 0 to give a job up at its first unknown outcome, or e.g. 20",
        )
    if not 0 < s.redelivery_delay <= 60:
        raise UnsafeSettings(
            f"{p}REDELIVERY_DELAY",
            f"must be > 0 and at most 60 seconds, got {s.redelivery_delay}",
            "use a first redelivery countdown such as 1",
        )


def _refuse_unsafe_delivery(s: Settings) -> None:
    """What the broker delivers: only safe serialisers, and no redelivery while a job waits."""
    p = ENV_PREFIX
    bad = [c for c in s.accept_content if c not in SAFE_CONTENT]
    if bad:
        raise UnsafeSettings(
            f"{p}ACCEPT_CONTENT",
            f"refusing serialisers {bad}: pickle and friends run code from the broker",
            "accept only json",
        )
    if s.max_countdown and s.max_countdown >= s.visibility_timeout:
        raise UnsafeSettings(
            f"{p}VISIBILITY_TIMEOUT",
            f"{s.visibility_timeout:g}s is not longer than the longest countdown "
            f"({s.max_countdown:g}s): the broker redelivers every such job while it waits",
            "raise JOBFENCE_VISIBILITY_TIMEOUT above JOBFENCE_MAX_COUNTDOWN",
        )


def refuse_url_timeouts(s: Settings) -> None:
    """A timeout in the lock URL's query wins over JOBFENCE_SOCKET_TIMEOUT in the client, so
    the effective value is the one checked against the lease."""
    limit = s.default_ttl - s.heartbeat_interval
    for name, value in security.query_timeouts(s.lock_url).items():
        if value is None or not 0 < value < limit:
            shown = "not a number" if value is None else f"{value:g}s"
            raise UnsafeSettings(
                f"{ENV_PREFIX}LOCK_URL",
                f"its option {name} ({shown}) overrides {ENV_PREFIX}SOCKET_TIMEOUT "
                f"({s.socket_timeout:g}s) and must be > 0 and shorter than TTL - heartbeat "
                f"interval ({limit:g}s), or a hung extension outlives the lease",
                f"remove {name} from the URL and set {ENV_PREFIX}SOCKET_TIMEOUT instead",
            )


def _local_ports(s: Settings) -> Iterable[tuple[str, int]]:
    """(variable, port) of every server URL in `s` on this host (the ports it must not take)."""
    for field in URL_FIELDS:
        url = getattr(s, field)
        if not url:
            continue
        for part in urlsplit(url).netloc.rpartition("@")[2].split(","):
            host, _, port = part.rpartition(":")
            host = host.strip("[]")
            if port.isdigit() and (is_loopback(host) or host in ("0.0.0.0", "::")):
                yield variable_name(field), int(port)


def refuse_metrics_clash(s: Settings) -> None:
    """JOBFENCE_METRICS_PORT: a real port, and not one a server jobfence talks to uses here;
    then the endpoint's other settings."""
    port = s.metrics_port
    if port is None:
        return
    variable = variable_name("metrics_port")
    if not 1 <= port <= 65535:
        raise UnsafeSettings(
            variable,
            f"must be a TCP port from 1 to 65535, got {port}",
            "pick a free port for each worker on a host, e.g. 9816, or unset it",
        )
    for other, taken in _local_ports(s):
        if taken == port:
            raise UnsafeSettings(
                variable,
                f"{port} is the port of {other}, a server on this host",
                "pick a free port for the metrics endpoint, e.g. 9816",
            )
    _refuse_bad_metrics_endpoint(s)


def _refuse_bad_metrics_endpoint(s: Settings) -> None:
    """The /metrics endpoint's HTTPS files (both or neither), its login and its address."""
    if (s.metrics_certfile is None) != (s.metrics_keyfile is None):
        raise UnsafeSettings(
            variable_name("metrics_certfile"),
            "and JOBFENCE_METRICS_KEYFILE must be set together (HTTPS needs both)",
            "set both to PEM files, or neither for plain HTTP",
        )
    auth = s.metrics_basic_auth
    if auth is not None and ":" not in auth.get_secret_value():
        raise UnsafeSettings(
            variable_name("metrics_basic_auth"),
            "must be user:password",
            "set it to e.g. prometheus:<a long random password>",
        )
    try:
        ipaddress.ip_address(s.metrics_addr)
    except ValueError:
        if s.metrics_addr != "localhost":
            raise UnsafeSettings(
                variable_name("metrics_addr"),
                "must be an IP address to listen on",
                "use 127.0.0.1 (this host, the default), 0.0.0.0 (every interface) or ::",
            ) from None


def warn_insecure(s: Settings) -> None:
    """Warn (not refuse: the worker's start-up check does) about each security downgrade
    JOBFENCE_ALLOW_INSECURE does not allow."""
    for d in s.downgrades():
        if d.item in s.allow_insecure:
            continue
        warnings.warn(
            f"{d.variable}: {d.problem}. Fix: {d.fix} (a worker refuses to start with it "
            f"unless {security.ALLOW_VARIABLE} includes {d.item})",
            InsecureSettingsWarning,
            stacklevel=2,
        )


def refuse_insecure(s: Settings) -> None:
    """Raise InsecureSettings for each security downgrade JOBFENCE_ALLOW_INSECURE does not
    allow. Judges the settings' text only (no I/O): call it before opening a connection."""
    found = [
        InsecureSettings(d.variable, d.problem, security.refusal_fix(d))
        for d in s.downgrades()
        if d.item not in s.allow_insecure
    ]
    if found:
        first, *also = found
        raise first.with_also(also) if also else first


def _fix_for(field: str, fields: Fields) -> str:
    """The fix a refusal of `field` suggests: its variable, what it is, its default."""
    info = fields.get(field)
    if info is None:
        return "remove it or correct its name"
    what = (info.description or "").rstrip(".")
    if field in ("key_secret", "key_secret_previous"):  # never shown, not even the dev default
        return f"set {variable_name(field)} to a long random string ({what})"
    return f"set {variable_name(field)} to a valid value ({what}; default {info.default!r})"


def unsafe_from(exc: ValidationError, fields: Fields) -> UnsafeSettings:
    """One UnsafeSettings for every problem pydantic found in a model of `fields`, built
    without the input values."""
    found: list[UnsafeSettings] = []
    for err in exc.errors(include_input=False, include_url=False):
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, UnsafeSettings):
            found.append(cause)
            continue
        field = str(err["loc"][0]) if err["loc"] else ""
        msg = err["msg"].removeprefix("Value error, ")
        fix = _fix_for(field, fields)
        if err["type"] == "finite_number":
            msg = "must be a finite number; NaN and infinity are refused"
            fix = fix.replace("to a valid value", "to a finite number", 1)
        variable = variable_name(field) if field else "settings"
        found.append(UnsafeSettings(variable, msg, fix))
    first, *also = found
    return first.with_also(also) if also else first


def undecodable(exc: SettingsError, fields: Fields) -> UnsafeSettings:
    """pydantic-settings names the field in its message: keep the name, drop the rest."""
    text = str(exc)
    field = next((f for f in fields if f'"{f}"' in text), "")
    return UnsafeSettings(
        variable_name(field) if field else "settings",
        "could not be decoded",
        _fix_for(field, fields) if field else "check the JOBFENCE_* variables",
    )
