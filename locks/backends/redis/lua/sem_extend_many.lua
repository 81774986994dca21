-- sem_extend_many.lua: owner-checked extension of many semaphore slots in one round trip.
-- KEYS[5i-4..5i] slot i's semaphore: slots zset (owner -> lease end, server ms), queue,
-- queue expiry, state, holders (as sem_acquire.lua)
-- ARGV[1] retention ms of the keys  ARGV[2i] owner token of slot i  ARGV[2i+1] new ttl ms
-- Returns a list with, for each slot, 1 if extended, 0 if not held (lapsed or released).
-- A lapsed slot is never revived: its place may already have gone to a waiter. An extended
-- slot pushes its semaphore's keys' expiry out as a grant does: held for longer than the
-- retention, they must not vanish under it (a waiter would get in at once).
redis.replicate_commands()
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS / 5 do
  local slots, owner, ttl = KEYS[5 * i - 4], ARGV[2 * i], tonumber(ARGV[2 * i + 1])
  local ok, ends = pcall(redis.call, 'ZSCORE', slots, owner)
  if ok and ends and tonumber(ends) > now_ms then
    redis.call('ZADD', slots, 'XX', now_ms + ttl, owner)
    local keep = math.max(tonumber(ARGV[1]), ttl)
    for k = 5 * i - 4, 5 * i do
      redis.call('PEXPIRE', KEYS[k], keep)
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
