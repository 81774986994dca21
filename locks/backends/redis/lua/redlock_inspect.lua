-- redlock_inspect.lua: what one master knows of a lock, without its owner token.
-- KEYS[1] lock hash
-- Returns {fence, task_id, holder, acquired_ms, heartbeat_ms, pttl}; fence is false while the
-- lock carries none (a grant between its two phases), pttl -2 if there is no lock.
local f = redis.call('HMGET', KEYS[1], 'fence', 'task_id', 'holder', 'acquired_ms', 'heartbeat_ms')
return {f[1], f[2] or '', f[3] or '', f[4] or '0', f[5] or '', redis.call('PTTL', KEYS[1])}
