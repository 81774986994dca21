"""Lazy re-exports (PEP 562): a package names its public objects without importing the
libraries behind them (Celery, SQLAlchemy, redis-py) until one is first used."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

Hooks = tuple[Callable[[str], Any], Callable[[], list[str]]]


def lazy_exports(package: str, exports: Mapping[str, str]) -> Hooks:
    """A module ``__getattr__`` and ``__dir__`` for `package`: each name in `exports` is
    imported from the module it maps to on first access, then kept in the package."""
    return _hooks(package, exports, exports.__getitem__)


def lazy_reexports(package: str, names: Collection[str], sources: Sequence[str]) -> Hooks:
    """As `lazy_exports`, for names each found in one of `sources` (packages listed in import
    order, searched in that order on first access), so `package` lists them only in
    ``__all__``."""

    def locate(name: str) -> str:
        for source in sources:
            if hasattr(importlib.import_module(source), name):
                return source
        raise AttributeError(f"{package}.{name} is public, but none of {list(sources)} has it")

    return _hooks(package, names, locate)


def _hooks(package: str, names: Collection[str], locate: Callable[[str], str]) -> Hooks:
    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(locate(name)), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
