-- extend_many.lua: owner-checked extension of many locks in one round trip.
-- KEYS[i] lock hash i
-- ARGV[2i-1] owner token of lock i  ARGV[2i] new ttl ms of lock i
-- Returns a list with, for each lock, 1 if extended, 0 if not ours (that one unchanged).
-- A key that is no lock hash any more (overwritten with another type) is not ours: 0 for
-- it, instead of an error that would fail the extension of every lock in the batch.
redis.replicate_commands()
local t = redis.call('TIME')
local now_ms = t[1] .. string.sub(string.format('%06d', t[2]), 1, 3)
local out = {}
for i, key in ipairs(KEYS) do
  local ok, owner = pcall(redis.call, 'HGET', key, 'owner')
  if ok and owner == ARGV[2 * i - 1] then
    redis.call('HSET', key, 'heartbeat_ms', now_ms)
    redis.call('PEXPIRE', key, ARGV[2 * i])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
