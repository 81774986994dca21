-- sem_extend_many.lua: owner-checked extension of many semaphore slots in one round trip.
-- KEYS[i] slots zset of slot i (owner -> lease end, server ms)
-- ARGV[2i-1] owner token of slot i  ARGV[2i] new ttl ms of slot i
-- Returns a list with, for each slot, 1 if extended, 0 if not held (lapsed or released).
-- A lapsed slot is never revived: its place may already have gone to a waiter.
redis.replicate_commands()
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i, key in ipairs(KEYS) do
  local ok, ends = pcall(redis.call, 'ZSCORE', key, ARGV[2 * i - 1])
  if ok and ends and tonumber(ends) > now_ms then
    redis.call('ZADD', key, 'XX', now_ms + tonumber(ARGV[2 * i]), ARGV[2 * i - 1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
