"""Loads the Lua scripts shipped in locks/backends/redis/lua once per Redis client."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

SCRIPT_NAMES = ("begin", "extend", "extend_many", "release", "commit", "fenced_write",
                "claim_publish", "swap_publish", "release_grant", "decisions_append")
RATE_SCRIPTS = ("rate_take",)  # the rate limiter's (locks/ratelimit.py), loaded the same way


@cache
def script_source(name: str) -> str:
    lua = resources.files("jobfence.locks.backends.redis").joinpath("lua", f"{name}.lua")
    return lua.read_text(encoding="utf-8")


def load_scripts(client: Any) -> dict[str, Any]:
    """Register every script on `client`; redis-py's Script reloads it after a server restart."""
    names = (*SCRIPT_NAMES, *RATE_SCRIPTS)
    return {name: client.register_script(script_source(name)) for name in names}
