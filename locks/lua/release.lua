-- release.lua: owner-checked release; wakes one blocked waiter through the signal list.
-- KEYS[1] lock hash  KEYS[2] signal list
-- ARGV[1] owner token  ARGV[2] signal lifetime ms
-- Returns 1 if released, 0 if the lock is gone or belongs to another owner (nothing changed).
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('RPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], -1, -1)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
