"""Loads the Lua scripts shipped in locks/backends/redis/lua once per Redis client."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

SCRIPT_NAMES = ("begin", "extend", "extend_many", "release", "commit", "fenced_write",
                "claim_publish", "swap_publish", "release_grant", "decisions_append")
RATE_SCRIPTS = ("rate_take",)  # the rate limiter's (locks/ratelimit.py), loaded the same way


#: A line that puts a fragment's text (lua/<name>.lua, a local function) in its place.
INCLUDE = "-- include: "


@cache
def script_source(name: str) -> str:
    """The script's text, each `-- include: <fragment>` line replaced by the fragment's."""
    lua = resources.files("jobfence.locks.backends.redis").joinpath("lua", f"{name}.lua")
    lines = lua.read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(
        script_source(line.removeprefix(INCLUDE).strip()) if line.startswith(INCLUDE) else line
        for line in lines
    )


def load_scripts(client: Any) -> dict[str, Any]:
    """Register every script on `client`; redis-py's Script reloads it after a server restart."""
    names = (*SCRIPT_NAMES, *RATE_SCRIPTS)
    return {name: client.register_script(script_source(name)) for name in names}
