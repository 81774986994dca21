"""Idempotency keys: task name plus bound arguments, canonical JSON, HMAC-SHA256."""

from __future__ import annotations

import functools
import hashlib
import hmac
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jobfence.tasks.errors import ArgumentsNotSerializable

KeySelector = Sequence[str] | Callable[..., Any] | None


# Built once: json.dumps with these options would build an encoder on every call.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def canonical_json(value: Any, *, what: str = "arguments") -> str:
    """Sorted keys, no whitespace, no NaN: equal values give equal text."""
    try:
        return _CANONICAL.encode(value)
    except (TypeError, ValueError) as exc:
        raise ArgumentsNotSerializable(
            f"{what} must be JSON-serialisable (str, int, float, bool, None, list, dict); "
            "pass ids instead of objects",
            cause=exc,
        ) from exc


@functools.lru_cache(maxsize=1024)
def _shape(fn: Callable[..., Any]) -> tuple[inspect.Signature, tuple[str, ...] | None]:
    """inspect.signature once per function (it is rebuilt on every call otherwise), and
    the parameter names if every parameter is a plain positional-or-keyword one."""
    sig = inspect.signature(fn)
    plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
    return sig, tuple(sig.parameters) if plain else None


def bind_arguments(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    skip_first: bool = False,
) -> dict[str, Any]:
    """Arguments by parameter name, defaults applied, so f(1) and f(x=1) give one key."""
    try:
        sig, plain = _shape(fn)
    except TypeError:  # an unhashable callable: no cache
        sig, plain = inspect.signature(fn), None
    if plain is not None and not skip_first and not kwargs and len(args) == len(plain):
        return dict(zip(plain, args, strict=True))  # what the general path gives, faster
    if skip_first:
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise ArgumentsNotSerializable(
            f"arguments do not match the signature of {getattr(fn, '__name__', fn)}: {exc}"
        ) from exc
    bound.apply_defaults()
    out = dict(bound.arguments)
    names = set(sig.parameters)
    for name, p in sig.parameters.items():  # flatten *args / **kwargs for stable keys
        if p.kind is p.VAR_KEYWORD and name in out:
            extra = out.pop(name)
            if names.isdisjoint(extra):
                out.update(extra)
            else:  # a keyword named like a parameter (f(args=[1]) vs f(1)): keep it apart
                out[name] = extra
        elif p.kind is p.VAR_POSITIONAL and name in out:
            out[name] = list(out[name])
    return out


def _hmac(secret: bytes, text: str) -> str:
    return hmac.digest(secret, text.encode(), hashlib.sha256).hex()  # one-shot, in C


def select_arguments(arguments: dict[str, Any], selector: KeySelector) -> Any:
    """The part of the arguments that makes a job unique."""
    if selector is None:
        return arguments
    if callable(selector):
        return selector(**arguments)
    missing = [n for n in selector if n not in arguments]
    if missing:
        raise ArgumentsNotSerializable(
            f"key names unknown arguments {missing}; choose from {sorted(arguments)}"
        )
    return {n: arguments[n] for n in selector}


def job_key(
    secret: bytes,
    task_name: str,
    arguments: dict[str, Any],
    *,
    selector: KeySelector = None,
    explicit: str | None = None,
) -> str:
    """`<task name>:<hmac>`; arguments never appear in the key."""
    unique = explicit if explicit is not None else select_arguments(arguments, selector)
    return _key_of(secret, task_name, canonical_json(unique))


def fingerprint(secret: bytes, arguments: dict[str, Any]) -> str:
    """A digest of all arguments, to tell a duplicate from a conflicting reuse of a key."""
    return _fingerprint_of(secret, canonical_json(arguments))


def identity(
    secret: bytes,
    task_name: str,
    arguments: dict[str, Any],
    *,
    selector: KeySelector = None,
    explicit: str | None = None,
) -> tuple[str, str]:
    """(job_key, fingerprint) at once: the arguments' JSON is built once when both use it."""
    text = canonical_json(arguments)
    if explicit is None and selector is None:
        key = _key_of(secret, task_name, text)
    else:
        key = job_key(secret, task_name, arguments, selector=selector, explicit=explicit)
    return key, _fingerprint_of(secret, text)


def _key_of(secret: bytes, task_name: str, unique_json: str) -> str:
    return f"{task_name}:{_hmac(secret, task_name + chr(10) + unique_json)[:40]}"


def _fingerprint_of(secret: bytes, arguments_json: str) -> str:
    return _hmac(secret, arguments_json)[:32]
