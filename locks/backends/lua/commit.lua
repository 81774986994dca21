-- commit.lua: store a job's final record and release its lock, atomically, if still the owner.
-- KEYS[1] lock hash  KEYS[2] job record hash  KEYS[3] signal list
-- ARGV[1] owner token  ARGV[2] state (DONE | FAILED)  ARGV[3] result JSON
-- ARGV[4] argument fingerprint  ARGV[5] fence  ARGV[6] record ttl ms  ARGV[7] signal lifetime ms
-- Returns 1 if stored and released, 0 if no longer the owner (nothing written).
-- The record is written whole (every field a record has), so no DEL is needed first; the
-- signal is pushed only if a refused attempt marked the lock 'waiters' (see begin.lua).
redis.replicate_commands()
local cur = redis.call('HMGET', KEYS[1], 'owner', 'waiters')
if cur[1] ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
redis.call('HSET', KEYS[2], 'state', ARGV[2], 'result', ARGV[3], 'fingerprint', ARGV[4],
  'fence', ARGV[5], 'finished_ms', t[1] .. string.sub(string.format('%06d', t[2]), 1, 3))
redis.call('PEXPIRE', KEYS[2], ARGV[6])
redis.call('DEL', KEYS[1])
if cur[2] then
  redis.call('RPUSH', KEYS[3], '1')
  redis.call('LTRIM', KEYS[3], -1, -1)
  redis.call('PEXPIRE', KEYS[3], ARGV[7])
end
return 1
