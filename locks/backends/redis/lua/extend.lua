-- extend.lua: owner-checked extension of one lock.
-- KEYS[1] lock hash
-- ARGV[1] owner token  ARGV[2] new ttl ms
-- Returns 1 if extended, 0 if the lock is gone or belongs to another owner (nothing changed).
redis.replicate_commands()
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'heartbeat_ms', t[1] .. string.sub(string.format('%06d', t[2]), 1, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
