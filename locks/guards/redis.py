"""Fence guards on Redis: one Lua script checks the token, advances it, then writes (sync and
asyncio clients; a write resent after a lost reply never applies twice)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis import ConnectionPool, Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Lane sends on a pool's connections and never re-sends a command that went out.
from jobfence.locks.backends.redis.lane import Lane
from jobfence.locks.backends.redis.scripts import load_scripts, script_source
from jobfence.locks.errors import (
    BackendUnavailable,
    FencedWriteRefused,
    LockError,
    PartialFencedWrite,
    StaleFence,
    StaleFenceOutcomeUnknown,
)
from jobfence.locks.guards.args import check_args
from jobfence.locks.keys import KeySpace


class _FencedWrites:
    """What the sync and asyncio Redis fence guards share: the checks and the script's
    keys and arguments (the reply: `_outcome`)."""

    client: Any
    keys: KeySpace

    def _request(
        self,
        resource: str,
        fence: int,
        commands: Sequence[Sequence[str | int | float]],
        write_id: str,
        keys: Sequence[str] | None,
        record: JobRecordArgs | None = None,
    ) -> tuple[list[str], list[Any]]:
        """fenced_write.lua's keys and arguments, after checking them; with `record`, the
        job's DONE record is read first and written with the commands."""
        check_args(resource, fence)
        if not isinstance(write_id, str) or len(write_id) > 255:
            raise LockError("write_id must be a string of at most 255 characters", key=resource)
        touched = list(keys) if keys is not None else [str(c[1]) for c in commands if len(c) > 1]
        self._check_one_slot(resource, fence, touched)
        body = json.dumps([[_arg(a) for a in c] for c in commands])
        k = self.keys
        if record is None:
            return [k.resource_fence(resource), k.resource_writes(resource), *touched], [
                fence, write_id, body,
            ]  # fmt: skip
        name = k.effect_record(resource, record.key)
        return [k.resource_fence(resource), k.resource_writes(resource), name, *touched], [
            fence, write_id, body, record.fingerprint, record.result, record.ttl_ms,
        ]  # fmt: skip

    def _check_one_slot(self, resource: str, fence: int, touched: list[str]) -> None:
        """On a cluster client (it has `keyslot`), refuse keys outside the resource's slot:
        the script must run where its fence lives, and a cluster runs it in one slot."""
        keyslot = getattr(self.client, "keyslot", None)
        if keyslot is None:
            return
        home = keyslot(self.keys.resource_fence(resource))
        for index, name in enumerate(touched, 1):
            if keyslot(name) != home:
                raise FencedWriteRefused(
                    resource=resource, fence=fence, index=None,
                    reason=f"key {index} of the write is in another hash slot than its "
                    "resource's, and on a Redis Cluster a fenced write runs in one slot; put "
                    "the resource in braces in the key's name, "
                    f"e.g. 'balance:{{{resource}}}'",
                )  # fmt: skip


class RedisFenceGuard(_FencedWrites):
    """Fenced writes on Redis: one Lua script checks the token, advances it, then writes.

    A write is idempotent per (resource, fence, write id): a resend after a lost reply
    returns the first answer and applies nothing. The first reply is kept beside the
    resource's fence until the fence advances. Under one fence, each distinct write needs
    its own `write_id`; the default ("") allows one write per fence.

    The client's own retries are never used (redis-py retries by default, and a blind
    resend of a non-idempotent script applied it twice): a plain `redis.Redis` is driven
    through connections of its pool that never re-send, and the guard re-sends itself,
    `resends` times, safely. Another client type (a cluster client) is refused if it
    retries. Known commands are checked first, inside the script: a write one of them
    would fail (wrong type, not an integer, arity) is refused whole (FencedWriteRefused);
    an error the check cannot foresee raises PartialFencedWrite saying what was applied.
    """

    def __init__(self, client: Redis, *, prefix: str = "jobfence", resends: int = 2) -> None:
        if not isinstance(resends, int) or isinstance(resends, bool) or resends < 0:
            raise LockError(f"resends must be an int >= 0, got {resends!r}")
        self.client = client
        self.keys = KeySpace(prefix)
        self.resends = resends
        self.script = load_scripts(client)["fenced_write"]
        pool = getattr(client, "connection_pool", None)
        if type(client) is Redis and isinstance(pool, ConnectionPool):
            self._lane: Lane | None = Lane(pool)
        else:
            self._lane = None
            _refuse_retrying(client)

    def write(
        self,
        resource: str,
        fence: int,
        commands: Sequence[Sequence[str | int | float]],
        *,
        write_id: str = "",
        keys: Sequence[str] | None = None,
    ) -> list[Any]:
        """Run `commands` (e.g. [("HSET", "acct:1", "balance", 90)]) if `fence` is not stale.

        Returns the replies of the commands; a resend of the same (resource, fence,
        write_id) returns the first replies and applies nothing. Raises StaleFence
        (nothing written), FencedWriteRefused (nothing written: a command would fail, or
        `write_id` was used under this fence with other commands) or PartialFencedWrite.
        `keys` lists the keys written; by default each command's first argument.
        """
        script_keys, args = self._request(resource, fence, commands, write_id, keys)
        reply, lost = self._send(resource, fence, script_keys, args)
        return _outcome(resource, fence, reply, lost)

    def write_recorded(
        self,
        resource: str,
        fence: int,
        commands: Sequence[Sequence[str | int | float]],
        record: JobRecordArgs,
        *,
        keys: Sequence[str] | None = None,
    ) -> RecordedWrite:
        """`write`, and the job's DONE record (`record`) in the same script, beside the
        resource: if the record is there already, the job took effect before (a re-run
        granted again after the lock server lost its data, a resend after a lost reply) and
        nothing is applied; its stored result answers. A fence guard alone refuses older
        fences, never a re-run under a newer one: this refuses both."""
        script_keys, args = self._request(resource, fence, commands, "", keys, record)
        reply, lost = self._send(resource, fence, script_keys, args)
        return _recorded(resource, fence, reply, lost, record)

    def advance(self, resource: str, fence: int) -> int:
        """Raise the resource's floor to `fence` (no write); return the floor now in force.

        After a forced release, this makes a dead or frozen holder's writes fail at once.
        """
        try:
            self.write(resource, fence, [], write_id="jobfence:advance")
        except StaleFence as exc:
            assert exc.last is not None
            return exc.last
        return fence

    def last(self, resource: str) -> int | None:
        value = self.client.get(self.keys.resource_fence(resource))
        return None if value is None else int(value)

    def _send(
        self, resource: str, fence: int, keys: list[str], args: list[Any]
    ) -> tuple[list[Any], bool]:
        """The script's reply, and whether an earlier attempt's reply was lost."""
        lost: RedisError | None = None
        for _ in range(self.resends + 1):
            try:
                return list(self._evalsha(keys, args)), lost is not None
            except (RedisConnectionError, RedisTimeoutError) as exc:
                lost = exc  # the script may have run: only a resend tells, and it is safe
            except ResponseError as exc:
                raise _refused_by_server(resource, fence, exc) from exc
        raise _unknown_after_resends(resource, fence, self.resends, lost)

    def _evalsha(self, keys: list[str], args: list[Any]) -> Any:
        script = self.script
        for attempt in (1, 2):
            try:
                if self._lane is not None:
                    return self._lane.call("EVALSHA", script.sha, len(keys), *keys, *args)
                return self.client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                if attempt == 2:
                    raise
                script.sha = self.client.script_load(script.script)
        raise AssertionError("unreachable")


def _arg(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise LockError(
            f"fenced write arguments must be str, int, float or bytes, got {type(value).__name__}"
        )
    return str(value)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _outcome(resource: str, fence: int, reply: list[Any], lost: bool) -> list[Any]:
    """fenced_write.lua's reply: the commands' replies, or the refusal raised."""
    code = int(reply[0])
    if code in (1, 2):
        return list(reply[2:])
    if code == 0:
        error = StaleFenceOutcomeUnknown if lost else StaleFence
        raise error(resource=resource, fence=fence, last=int(reply[1]))
    if code == 3:
        raise FencedWriteRefused(
            resource=resource, fence=fence, index=int(reply[1]), reason=_text(reply[2])
        )
    if code == 4:
        raise FencedWriteRefused(
            resource=resource, fence=fence, index=None,
            reason="this write_id was used under this fence with other commands",
        )  # fmt: skip
    raise PartialFencedWrite(
        resource=resource,
        fence=fence,
        index=int(reply[2]),
        reason=_text(reply[3]),
        replies=list(reply[4:]),
    )


@dataclass(frozen=True)
class JobRecordArgs:
    """The DONE record a recorded fenced write stores with its commands (RedisEffects)."""

    key: str  # the job's idempotency key
    fingerprint: str  # its arguments' fingerprint: another one under the key is refused
    result: str  # the job's result, as JSON
    ttl_ms: int = 0  # how long the record is kept (0: for ever)


@dataclass(frozen=True)
class RecordedWrite:
    """What a recorded fenced write did: applied now (the commands' `replies`), or not
    because the job's DONE record was there (`result` is the one it stored, under `fence`)."""

    applied: bool
    fence: int
    result: str
    replies: list[Any]


def _recorded(
    resource: str, fence: int, reply: list[Any], lost: bool, record: JobRecordArgs
) -> RecordedWrite:
    code = int(reply[0])
    if code == 6:
        return RecordedWrite(False, int(reply[1]), _text(reply[2]), [])
    if code == 7:
        raise FencedWriteRefused(
            resource=resource, fence=fence, index=None,
            reason="the job key's DONE record beside this resource holds other arguments "
            "(a key reused with different arguments): use a new key or the original arguments",
        )  # fmt: skip
    return RecordedWrite(True, fence, record.result, _outcome(resource, fence, reply, lost))


def _refused_by_server(resource: str, fence: int, exc: ResponseError) -> FencedWriteRefused:
    # An error out of the script itself (not a command's: those are caught in it), e.g.
    # out of memory. The server checks memory at a script's first write only, and every
    # write but the commands' comes after them or is the first: so nothing was written.
    return FencedWriteRefused(
        resource=resource, fence=fence, index=None, reason=f"the server refused it: {exc}"
    )


def _unknown_after_resends(
    resource: str, fence: int, resends: int, lost: BaseException | None
) -> BackendUnavailable:
    return BackendUnavailable(
        f"fenced write outcome unknown after {resends + 1} attempts; resend it with "
        "the same fence and write_id to learn it (a resend never applies twice)",
        key=resource,
        fence=fence,
        cause=lost,
    )


class AsyncRedisFenceGuard(_FencedWrites):
    """RedisFenceGuard for asyncio: the same script, checks and replies, sent through a
    `redis.asyncio.Redis` client that must not retry on its own (the guard re-sends).

        guard = AsyncRedisFenceGuard(redis.asyncio.Redis.from_url(url, retry=Retry(NoBackoff(), 0)))
        await guard.write("acct:1", lease.fence, [("HSET", "acct:1", "balance", 90)])
    """

    def __init__(self, client: Any, *, prefix: str = "jobfence", resends: int = 2) -> None:
        if not isinstance(resends, int) or isinstance(resends, bool) or resends < 0:
            raise LockError(f"resends must be an int >= 0, got {resends!r}")
        _refuse_retrying(client)
        self.client = client
        self.keys = KeySpace(prefix)
        self.resends = resends
        self.source = script_source("fenced_write")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def write(
        self,
        resource: str,
        fence: int,
        commands: Sequence[Sequence[str | int | float]],
        *,
        write_id: str = "",
        keys: Sequence[str] | None = None,
    ) -> list[Any]:
        """As RedisFenceGuard.write, awaited: StaleFence if `fence` is stale (nothing written)."""
        script_keys, args = self._request(resource, fence, commands, write_id, keys)
        lost: RedisError | None = None
        for _ in range(self.resends + 1):
            try:
                reply = await self._evalsha_async(script_keys, args)
                return _outcome(resource, fence, list(reply), lost is not None)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                lost = exc  # the script may have run: only a resend tells, and it is safe
            except ResponseError as exc:
                raise _refused_by_server(resource, fence, exc) from exc
        raise _unknown_after_resends(resource, fence, self.resends, lost)

    async def _evalsha_async(self, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.sha = await self.client.script_load(self.source)
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)

    async def last(self, resource: str) -> int | None:
        value = await self.client.get(self.keys.resource_fence(resource))
        return None if value is None else int(value)


def _refuse_retrying(client: Any) -> None:
    """Refuse a client that would re-send a command on its own after a timeout."""
    get_retry = getattr(client, "get_retry", None)
    retry = get_retry() if callable(get_retry) else None
    retries = retry.get_retries() if retry is not None else 0
    if retries:
        raise LockError(
            "RedisFenceGuard needs a client that does not retry on its own "
            f"({type(client).__name__} retries {retries} times): build it with "
            "retry=Retry(NoBackoff(), 0) (redis.retry, redis.backoff); the guard re-sends "
            "itself, safely, with the same fence and write id"
        )
