-- release.lua: owner-checked release; wakes blocked waiters through the signal list.
-- KEYS[1] lock hash  KEYS[2] signal list
-- ARGV[1] owner token  ARGV[2] signal lifetime ms
-- Returns 1 if released, 0 if the lock is gone or belongs to another owner (nothing changed).
-- The signal is pushed only if a refused attempt marked the lock 'waiters' (see begin.lua).
local cur = redis.call('HMGET', KEYS[1], 'owner', 'waiters')
if cur[1] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if cur[2] then
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('LTRIM', KEYS[2], -1, -1)
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return 1
