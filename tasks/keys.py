"""Idempotency keys: task name plus bound arguments, canonical JSON, HMAC-SHA256."""

from __future__ import annotations

import difflib
import enum
import functools
import hashlib
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jobfence.tasks.errors import ArgumentsNotSerializable, BadArguments, TaskDefinitionError

# Argument names (one name as a plain string), a callable of the arguments, or None (all).
KeySelector = str | Sequence[str] | Callable[..., Any] | None


# Built once: json.dumps with these options would build an encoder on every call.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def _default(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _c_encode(value: Any) -> str:
    """What `_CANONICAL.encode` returns, with the C encoder called directly: encode() spends
    more in its Python layers than the C scanner spends on a job's few arguments. A fresh
    markers dict per call keeps the circular-reference check (and thread safety)."""
    return "".join(
        _C_MAKE_ENCODER(  # markers, default, str encoder, indent, ':', ',', sort, skip, nan
            {}, _default, json.encoder.encode_basestring, None, ":", ",", True, False, False
        )(value, 0)
    )


_C_MAKE_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)
_encode: Callable[[Any], str] = _c_encode if _C_MAKE_ENCODER is not None else _CANONICAL.encode


_FIXES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("datetime", "date", "time"), "pass an ISO string (value.isoformat())"),
    (("Decimal",), "pass a string (str(value)) or integer cents"),
    (("UUID",), "pass str(value)"),
    (("set", "frozenset"), "pass a sorted list"),
    (("bytes", "bytearray", "memoryview"), "pass text (e.g. base64)"),
    (("timedelta",), "pass seconds as a number"),
)
_PLAIN = "JSON takes str, int, float, bool, None, list and dict: pass ids instead of objects"


def _problem(value: Any) -> tuple[str, str]:
    """(what is wrong, how to fix it) for one leaf JSON cannot hold; never shows the value."""
    if isinstance(value, float):
        return "NaN or infinity is not JSON-serialisable", "pass None, a finite number or a string"
    kind = type(value).__name__
    fix = next((f for kinds, f in _FIXES if kind in kinds), _PLAIN)
    if isinstance(value, enum.Enum):
        fix = "pass its .value"
    return f"{kind} is not JSON-serialisable", fix


def _culprit(value: Any, path: str) -> tuple[str, str, str] | None:
    """(path, problem, fix) of the first part of `value` JSON cannot hold, or None."""
    if value is None or isinstance(value, str | bool | int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, *_problem(value))
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _culprit(item, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(value, dict):
        kinds = {type(k) for k in value}
        if not kinds <= {str, int, float, bool, type(None)}:
            bad = next(k for k in value if not isinstance(k, str | int | float | bool | type(None)))
            return path, f"a dict key of type {type(bad).__name__}", "use string keys"
        if len(kinds) > 1:
            return path, "a dict whose keys mix types", "use string keys"
        for k, v in value.items():
            # A key is shown only if it reads like a field name: keys may be data too.
            shown = f".{k}" if isinstance(k, str) and k.isidentifier() and len(k) <= 40 else "[…]"
            found = _culprit(v, path + shown)
            if found:
                return found
        return None
    return (path, *_problem(value))


def canonical_json(value: Any, *, what: str = "arguments") -> str:
    """Sorted keys, no whitespace, no NaN: equal values give equal text."""
    try:
        return _encode(value)
    except (TypeError, ValueError) as exc:
        where, problem, fix = _culprit(value, "") or ("", "it is not JSON-serialisable", _PLAIN)
        at = f" (at {where.lstrip('.')})" if where else ""
        raise ArgumentsNotSerializable(f"{what}{at}: {problem}; {fix}", cause=exc) from exc


def result_json(value: Any, task_name: str) -> str:
    """`canonical_json` of a job's result; the error message is built only on failure."""
    try:
        return _encode(value)
    except (TypeError, ValueError):
        return canonical_json(value, what=f"the result of {task_name}")


def arguments_json(arguments: Mapping[str, Any], task_name: str) -> str:
    """`canonical_json` of bound arguments; a failure names the argument, never its value."""
    try:
        return _encode(arguments)
    except (TypeError, ValueError) as exc:
        for name, value in arguments.items():
            found = _culprit(value, name)
            if found:
                where, problem, fix = found
                at = f" (at {where})" if where != name else ""
                raise ArgumentsNotSerializable(
                    f"argument {name!r} of {task_name}{at}: {problem}; {fix}", cause=exc
                ) from exc
        raise ArgumentsNotSerializable(
            f"the arguments of {task_name} are not JSON-serialisable; {_PLAIN}", cause=exc
        ) from exc


_EMPTY = inspect.Parameter.empty


@functools.lru_cache(maxsize=1024)
def _shape(
    fn: Callable[..., Any],
) -> tuple[inspect.Signature, tuple[str, ...] | None, tuple[Any, ...]]:
    """inspect.signature once per function (it is rebuilt on every call otherwise); the
    parameter names if every parameter is a plain positional-or-keyword one, and their
    defaults (`inspect.Parameter.empty` where none)."""
    sig = inspect.signature(fn)
    plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
    defaults = tuple(p.default for p in sig.parameters.values())
    return sig, tuple(sig.parameters) if plain else None, defaults


def _bind_plain(
    names: tuple[str, ...], defaults: tuple[Any, ...], args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> dict[str, Any] | None:  # fmt: skip
    """`bind_arguments` for plain parameters, in their order with defaults applied, as
    Signature.bind gives it; None where the call does not fit (the general path says why)."""
    if len(args) > len(names):
        return None
    out = dict(zip(names, args, strict=False))
    used = 0
    for name, default in zip(names[len(args):], defaults[len(args):], strict=True):
        if name in kwargs:
            out[name] = kwargs[name]
            used += 1
        elif default is _EMPTY:
            return None
        else:
            out[name] = default
    return out if used == len(kwargs) else None  # a keyword left over: unknown or repeated


def bind_arguments(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    skip_first: bool = False,
    name: str | None = None,
) -> dict[str, Any]:
    """Arguments by parameter name, defaults applied, so f(1) and f(x=1) give one key.

    Arguments that do not fit the signature raise BadArguments (a TypeError) worded as
    Python words it for a plain call, with `name` (default: the function's) in front.
    """
    try:
        sig, plain, defaults = _shape(fn)
    except TypeError:  # an unhashable callable: no cache
        sig, plain, defaults = inspect.signature(fn), None, ()
    if plain is not None and not skip_first:
        fast = _bind_plain(plain, defaults, args, kwargs)  # what the general path gives
        if fast is not None:
            return fast
    if skip_first:
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        problem = _mismatch(sig, kwargs, exc)
        raise BadArguments(f"{name or getattr(fn, '__name__', fn)}() {problem}") from None
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


def _mismatch(sig: inspect.Signature, kwargs: Mapping[str, Any], exc: TypeError) -> str:
    """What is wrong, as a plain call says it: an unknown keyword before a missing argument."""
    params = sig.parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for k in kwargs:
            p = params.get(k)
            if p is None or p.kind is p.POSITIONAL_ONLY:
                return f"got an unexpected keyword argument {k!r}"
    return str(exc)


_BLOCK = 64  # SHA-256's block size, in bytes


@functools.lru_cache(maxsize=8)
def _keyed(secret: bytes) -> tuple[Any, Any]:
    """HMAC-SHA256's two hashes (RFC 2104) with the secret's inner and outer pads absorbed
    once; each digest copies them (hashlib's copies, a third cheaper than hmac.HMAC.copy's
    Python layer, which a delivery paid twice)."""
    key = hashlib.sha256(secret).digest() if len(secret) > _BLOCK else secret
    key = key.ljust(_BLOCK, b"\0")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
    outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
    return inner, outer


def _hmac(secret: bytes, text: str) -> str:
    """hmac.new(secret, text, sha256).hexdigest(), from the pads absorbed once."""
    inner_pad, outer_pad = _keyed(secret)
    inner = inner_pad.copy()
    inner.update(text.encode())
    outer = outer_pad.copy()
    outer.update(inner.digest())
    return outer.hexdigest()  # type: ignore[no-any-return]


def select_arguments(arguments: dict[str, Any], selector: KeySelector) -> Any:
    """The part of the arguments that makes a job unique."""
    if selector is None:
        return arguments
    if callable(selector):
        return selector(**arguments)
    if isinstance(selector, str):  # key="payment_id": that one argument
        selector = (selector,)
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
    if explicit is not None:
        text = canonical_json(explicit, what="idempotency_key")
    elif callable(selector):
        text = canonical_json(selector(**arguments), what=f"the key selector of {task_name}")
    else:
        text = arguments_json(select_arguments(arguments, selector), task_name)
    return _key_of(secret, task_name, text)


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
    text = arguments_json(arguments, task_name)
    if explicit is None and selector is None:
        key = _key_of(secret, task_name, text)
    else:
        key = job_key(secret, task_name, arguments, selector=selector, explicit=explicit)
    return key, _fingerprint_of(secret, text)


def secret_id(secret: bytes) -> str:
    """A name for the key secret that the lock server may keep: an HMAC of a constant under
    it, so equal secrets give equal ids and the id tells nothing of the secret."""
    return _hmac(secret, "jobfence key-secret id")[:16]


def _key_of(secret: bytes, task_name: str, unique_json: str) -> str:
    return f"{task_name}:{_hmac(secret, task_name + chr(10) + unique_json)[:40]}"


def _fingerprint_of(secret: bytes, arguments_json: str) -> str:
    return _hmac(secret, arguments_json)[:32]


def concurrency_key(
    secret: bytes, task_name: str, arguments: dict[str, Any], selector: KeySelector
) -> str:
    """The semaphore key of a job's concurrency group, `<task name>:<hmac>` of the selected
    arguments (selector None: the whole task is one group). Arguments never appear in it."""
    if selector is None:
        text = "null"
    elif callable(selector):
        text = canonical_json(selector(**arguments), what=f"the concurrency_key of {task_name}")
    else:
        text = arguments_json(select_arguments(arguments, selector), task_name)
    return _key_of(secret, task_name, "concurrency\n" + text)


def normalise_key(name: str, key: Any) -> KeySelector:
    """`key="payment_id"` means that one argument; a list or tuple, those; else a callable."""
    if key is None or callable(key):
        return key  # type: ignore[no-any-return]
    if isinstance(key, str):
        key = (key,)
    if not isinstance(key, list | tuple) or not all(isinstance(k, str) for k in key):
        raise TaskDefinitionError(
            f"{name} must be an argument name, a list of argument names or a callable, "
            f"got {type(key).__name__}"
        )
    if not key:
        raise TaskDefinitionError(
            f"{name}=[] names no argument, so every call would share one key; "
            "name the arguments that make a job unique, or leave key=None for all of them"
        )
    return tuple(key)


def check_key_names(func: Callable[..., Any], key: KeySelector, *, bound: bool, name: str) -> None:
    """Refuse, at decoration, a key naming something that is not a parameter of `func`, or
    a key callable that cannot take `func`'s arguments by name."""
    if key is None or isinstance(key, str):
        return
    params = list(inspect.signature(func).parameters.values())
    if bound and params:
        params = params[1:]  # `self`, the task: never part of a key
    names = [p.name for p in params]
    if callable(key):
        _check_key_callable(func, key, names, name)
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return  # any name may arrive through **kwargs
    for k in key:
        if k not in names:
            close = difflib.get_close_matches(k, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TaskDefinitionError(
                f"{name} names {k!r}, which is not a parameter of "
                f"{func.__name__}({', '.join(names)}){hint}"
            )


def _check_key_callable(
    func: Callable[..., Any], key: Callable[..., Any], names: list[str], name: str
) -> None:
    try:
        inspect.signature(key).bind(**dict.fromkeys(names))
    except TypeError as exc:
        raise TaskDefinitionError(
            f"{name} callable {getattr(key, '__name__', key)!r} is called with the arguments of "
            f"{func.__name__}({', '.join(names)}) by name, and {exc}; "
            "accept them all (add **_ for those it ignores)"
        ) from None
    except ValueError:  # no signature to read (a builtin): it is tried at publish
        return
