-- commit.lua: store a job's final record and release its lock, atomically, if still the owner.
-- KEYS[1] lock hash  KEYS[2] job record hash  KEYS[3] signal list
-- ARGV[1] owner token  ARGV[2] state (DONE | FAILED)  ARGV[3] result JSON
-- ARGV[4] argument fingerprint  ARGV[5] fence  ARGV[6] record ttl ms  ARGV[7] signal lifetime ms
-- Returns 1 if stored and released, 0 if no longer the owner (nothing written).
redis.replicate_commands()
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
local now_ms = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'state', ARGV[2], 'result', ARGV[3], 'fingerprint', ARGV[4],
  'fence', ARGV[5], 'finished_ms', now_ms)
redis.call('PEXPIRE', KEYS[2], ARGV[6])
redis.call('DEL', KEYS[1])
redis.call('RPUSH', KEYS[3], '1')
redis.call('LTRIM', KEYS[3], -1, -1)
redis.call('PEXPIRE', KEYS[3], ARGV[7])
return 1
