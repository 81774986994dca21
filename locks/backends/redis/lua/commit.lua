-- commit.lua: store a job's final record and release its lock, atomically, if still the owner.
-- KEYS[1] lock hash  KEYS[2] job record  KEYS[3] signal list
-- ARGV[1] owner token  ARGV[2] head: state letter (D | F) and fence, e.g. 'D1795382097870639'
-- ARGV[3] tail: '<length of the fingerprint>:<fingerprint><result JSON>'
-- ARGV[4] record ttl ms  ARGV[5] signal lifetime ms
-- Returns 1 if stored and released, 0 if no longer the owner (nothing written).
-- The record is one string, head .. ',' .. ms from grant to finish .. ',' .. tail: one key
-- per finished job, no field names, the finish time as a small offset from the fence's
-- microseconds (the client adds them back). SET replaces a record of any type, so no DEL
-- is needed first; the signal is pushed only if a refused attempt marked the lock 'waiters'
-- (see begin.lua).
-- include: release_signal
redis.replicate_commands()
local cur = redis.call('HMGET', KEYS[1], 'owner', 'waiters')
if cur[1] ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
local since = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  - math.floor(tonumber(string.sub(ARGV[2], 2)) / 1000)
redis.call('SET', KEYS[2], ARGV[2] .. ',' .. string.format('%.0f', since) .. ',' .. ARGV[3],
  'PX', ARGV[4])
release_and_signal(KEYS[1], KEYS[3], cur[2], ARGV[5])
return 1
